"""Leaving together: at interpreter exit, every process of a job that built a ``Pipeline`` waits
for its peers to reach exit too, then destroys its process groups while Python still runs.

Why: a process group left to the interpreter's teardown (a script that never calls
``destroy_process_group``, as the README's example does not) is destroyed among the C++ static
objects, in no defined order with what its threads use, and a finished 2-rank gloo job died
there with SIGABRT ("terminate called without an active exception") now and then. A group
destroyed while a peer still talks to it can abort too, so the ranks first meet: each adds one
to a counter in the default group's store and waits until every process that registered the
hook (every rank that built a pipeline) has. That meeting is
bounded (``EXIT_WAIT_S``, or less with a shorter pipeline timeout) and skipped when the process
exits on an uncaught exception (its peers may never arrive), and nothing of it raises: exit goes
on whatever the store says. A script that destroyed its groups itself leaves nothing to do.

The hook is registered once per process, the first time a pipeline is built (the store's count
of this rank's registrations says whether it was); interpreter exit is process-wide by nature.
"""

from __future__ import annotations

import atexit
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from pipetrain.runtime.torch_compat import store_of

#: the longest a process waits at exit for its peers to finish (s)
EXIT_WAIT_S = 60.0
_KEY = "pipetrain/exit"


def leave_together_at_exit(timeout: timedelta) -> None:
    """Register the exit hook of this process (once; later calls do nothing)."""
    if not dist.is_initialized():
        return
    try:
        store = store_of(None)
        if store.add(f"{_KEY}/hooks/{dist.get_rank()}", 1) != 1:
            return
        store.add(f"{_KEY}/registered", 1)
    except Exception:  # no store to count in: register nothing rather than twice
        return
    atexit.register(_leave, min(EXIT_WAIT_S, timeout.total_seconds()))


def _leave(wait_s: float) -> None:
    if not dist.is_initialized():  # the script destroyed its groups itself
        return
    if getattr(sys, "last_value", None) is None:  # not an uncaught exception's exit
        _meet(wait_s)
    try:
        dist.destroy_process_group()
    except Exception:  # already partly gone: nothing left worth reporting at exit
        pass


def _meet(wait_s: float) -> None:
    """Wait (at most ``wait_s``) until every process that registered the hook reached exit."""
    try:
        store = store_of(None)
        store.add(f"{_KEY}/arrived", 1)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if store.add(f"{_KEY}/arrived", 0) >= store.add(f"{_KEY}/registered", 0):
                break
            time.sleep(0.01)
    except Exception:  # the store went with rank 0, which left first: everyone arrived
        pass


__all__ = ["EXIT_WAIT_S", "leave_together_at_exit"]
