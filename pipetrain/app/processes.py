"""The worker processes of one ``pipetrain train`` run: started, watched, and stopped together.

The launcher (``start_processes``) starts every worker in a session of its own, so a terminal's
Ctrl-C reaches the launcher alone and the launcher decides what every worker does. It then
watches them:

* A worker that ends with a failure stops the others (they would wait for it until their
  timeout): they get ``SETTLE_S`` to end on their own first (each hears of the failure and
  writes its log), then SIGTERM. One that died by a signal is named: ``rank 1 (pid 4242)
  killed by SIGKILL``, the kernel's out-of-memory killer's signal.
* SIGTERM, SIGINT or SIGHUP to the launcher (``timeout``, ``kill``, Slurm, Kubernetes, Ctrl-C, a
  closed terminal) is forwarded to every worker as SIGTERM; a worker still there after the
  grace period (``--term-grace``) is killed. The launcher then exits with status 128 + the
  signal's number, as a shell reports a process the signal ended, after one line saying what
  happened — or, where the workers stopped on it together with a checkpoint
  (``--checkpoint-on-term``, ``app.termination``), with theirs, ``TERMINATED``.

A worker (``watch_launcher``) dies with its launcher: Linux's parent-death signal sends it
SIGTERM when the launcher goes, however it goes (SIGKILL included); elsewhere a watchdog thread
notices that its parent changed (a worker of torchrun's agent, ``die_with_parent``, dies with
the agent the same way). Workers keep the default action of SIGTERM, SIGINT and SIGHUP, unless
``--checkpoint-on-term`` catches SIGTERM: the process ends at once, wherever it is (a C++ wait
included), prints nothing, and runs no Python teardown that could wait on a peer. What a worker
was writing then is never half visible: checkpoints appear by a rename once complete
(``runtime.checkpoint``).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipetrain.app.termination import TERMINATED

#: the signals a launcher forwards (and a worker dies of by default)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: how long a worker may take to end after SIGTERM before it is killed (s)
GRACE_S = 3.0
#: how long the others may take to end on their own after a worker failed, before SIGTERM (s)
SETTLE_S = 1.0
#: the launcher's pid, in each worker's environment (the parent it must outlive no longer than)
LAUNCHER_PID = "PIPETRAIN_LAUNCHER_PID"
_POLL_S = 0.05
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Ended:
    """How a run's processes ended: ``status`` (0, a worker's exit status, or -signal for a
    worker a signal killed), ``rank`` and ``pid`` of the first to fail (-1: none),
    ``signalled``: the signal that stopped the launcher (0: none), and ``codes``."""

    status: int
    rank: int = -1
    pid: int = -1
    signalled: int = 0
    #: every worker's exit status once all ended (rank order; -signal for one a signal ended)
    codes: tuple[int, ...] = ()


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def start_processes(
    count: int, cmd: list[str], env: dict[str, str], term_grace: float = GRACE_S
) -> Ended:
    """Run ``cmd`` as ``count`` processes, process ``r`` with ``RANK`` and ``LOCAL_RANK`` ``r``
    added to ``env``; wait until all end, or stop them all at the first failure or a stop
    signal to this process (see the module docstring; ``term_grace``: how long they may take
    to stop after a stop signal, ``GRACE_S`` after a failure)."""
    base = {**env, LAUNCHER_PID: str(os.getpid())}
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    try:
        for r in range(count):
            if received:
                break
            rank_env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
            procs[r] = subprocess.Popen(cmd, env=rank_env, start_new_session=True)
        ended = _watch(procs, received)
        asked = bool(ended.signalled) or ended.status == TERMINATED  # SIGTERM reached workers
        if ended.status != 0 and not ended.signalled:
            _settle(procs, received, term_grace if asked else SETTLE_S)
        _stop(procs, received, term_grace if asked else GRACE_S)
        codes = tuple(p.returncode for p in procs.values())
        return dataclasses.replace(ended, codes=codes)
    finally:
        for p in procs.values():  # only if this function itself failed
            if p.poll() is None:
                p.kill()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _watch(procs: dict[int, subprocess.Popen[bytes]], received: list[int]) -> Ended:
    """Wait until every process ended (``Ended(0)``), one failed, or a signal came."""
    running = dict(procs)
    while running:
        if received:
            return Ended(0, signalled=received[0])
        for r, p in list(running.items()):
            code = p.poll()
            if code is None:
                continue
            del running[r]
            if code != 0:
                return Ended(code, rank=r, pid=p.pid, signalled=received[0] if received else 0)
        time.sleep(_POLL_S)
    return Ended(0, signalled=received[0] if received else 0)


def _settle(procs: dict[int, subprocess.Popen[bytes]], received: list[int], wait: float) -> None:
    """Wait up to ``wait`` s for every process to end (a signal to the launcher ends it)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not received:
        if all(p.poll() is not None for p in procs.values()):
            return
        time.sleep(_POLL_S)


def _stop(procs: dict[int, subprocess.Popen[bytes]], received: list[int], grace: float) -> None:
    """SIGTERM every process still running, then SIGKILL what is left after ``grace`` s (or at
    once, on a second signal to the launcher)."""
    alive = [p for p in procs.values() if p.poll() is None]
    seen = len(received)
    for p in alive:
        _send(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline and len(received) == seen:
        time.sleep(_POLL_S)
        alive = [p for p in alive if p.poll() is None]
    for p in alive:
        _send(p, signal.SIGKILL)
        p.wait()


def _send(p: subprocess.Popen[bytes], number: int) -> None:
    try:
        p.send_signal(number)
    except ProcessLookupError:  # it ended meanwhile
        pass


def watch_launcher() -> None:
    """In a worker: end (SIGTERM) when the launcher does, and die of the stop signals at once
    (no ``KeyboardInterrupt``). Outside a launcher's workers, nothing."""
    launcher = os.environ.get(LAUNCHER_PID)
    if launcher is None:
        return
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    # the launcher may have gone before the parent-death signal was set
    _check_parent(int(launcher), lambda: os.kill(os.getpid(), signal.SIGTERM))
    watchdog = threading.Thread(
        target=_watchdog, args=(int(launcher),), name="pipetrain-launcher-watchdog", daemon=True
    )
    watchdog.start()


def die_with_parent() -> None:
    """In a worker of torchrun's agent (or ``app.restart``'s): end (SIGTERM) when the agent
    does, however it goes, instead of training on as an orphan. Linux only; elsewhere
    nothing."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _check_parent(launcher: int, stop: Callable[[], None]) -> bool:
    if os.getppid() != launcher:
        stop()
        return False
    return True


def _watchdog(launcher: int) -> None:
    """Where no parent-death signal exists (or it was lost): poll the parent once a second."""
    while _check_parent(launcher, lambda: os.kill(os.getpid(), signal.SIGTERM)):
        time.sleep(1.0)


__all__ = [
    "GRACE_S",
    "LAUNCHER_PID",
    "SETTLE_S",
    "STOP_SIGNALS",
    "Ended",
    "die_with_parent",
    "signal_name",
    "start_processes",
    "watch_launcher",
]
