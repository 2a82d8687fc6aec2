"""When one rank fails, every rank stops within seconds, naming the rank that failed and why.

A pipeline's ranks wait on each other all the time; a rank that raises (a stage's exception, a
bad loss, a construction error) would otherwise leave its peers waiting until ``timeout``, then
reporting a receive timeout with no hint of the cause. So a rank that fails (``Failures.post``)

1. writes a notice — which rank failed first and its message — under the pipeline's keys in the
   process group's store, then
2. closes its pipeline-owned transfer group (``Pipeline`` makes one per pipeline on gloo), so every
   peer blocked on it gets "connection closed" at once instead of waiting out the timeout.

A peer whose wait fails reads the notices (``Failures.explain``) and raises ``PeerFailedError``
naming the first failing rank and its message, then does the same two steps, so the news travels
down the pipeline. A refusal — a ``ValueError`` while building the pipeline, or
``PipelineRefused`` at a step (a stage's graph pipetrain cannot run exactly) — is marked in its
notice, and every peer raises ``PipelineRefused`` (a ``ValueError``) instead, with the same
words: a configuration error is the same type on every rank, the one the docs name, so a
launcher that catches ``ValueError`` treats every rank alike. Where no notice arrives (the
failing process died, or took the store with it) the error says the peer closed the
connection. Notices are read only after a wait has failed:
nothing of this runs in a healthy step.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

import torch.distributed as dist

from pipetrain.runtime.torch_compat import store_of

P = ParamSpec("P")
R = TypeVar("R")
Built = TypeVar("Built")


class PeerFailedError(RuntimeError):
    """Another rank of the pipeline failed (or closed its connection) first; ``origin`` is the
    first rank known to have failed, ``notice`` what it said (passed on as it is, so the news
    does not nest as it travels down the pipeline)."""

    origin: int = -1
    notice: str | None = None


class PipelineRefused(ValueError):
    """pipetrain refused the configuration (while building the pipeline, or at the first step
    that showed it), raised on every rank: where it was found with its own message, on the peers
    naming that rank and its message (``origin``, ``notice``: as for ``PeerFailedError``, set
    on the peers' only, so that the rank that raises it first is taken as the origin)."""

    origin: int
    notice: str | None


def refusal(error: BaseException) -> bool:
    """Whether ``error`` is a refusal every peer should raise as ``PipelineRefused``."""
    return isinstance(error, PipelineRefused)


def notice_of(error: BaseException, phase: str | None = None) -> str:
    """What a rank stopping because of ``error`` tells its peers: a failure it heard of, as its
    origin said it; its own, named (and the construction ``phase`` it happened in)."""
    heard = getattr(error, "notice", None)
    if isinstance(error, (PeerFailedError, PipelineRefused)) and heard is not None:
        return heard
    text = f"{type(error).__name__}: {error}"
    return f"building its Pipeline ({phase}): {text}" if phase else text


#: a notice read: (the first failing rank, its message, whether it was a refusal)
Notice = tuple[int, str, bool]


def first_notice(notices: dict[int, Notice]) -> Notice:
    """Of the notices read (poster -> notice), the origin's own where it posted one."""
    own = [n for r, n in notices.items() if r == n[0]]
    return min(own or notices.values())


def peer_error(text: str, notice: Notice) -> PeerFailedError | PipelineRefused:
    """The error a peer raises for ``notice`` (``text`` names it): ``PipelineRefused`` for a
    refusal, else ``PeerFailedError``."""
    origin, message, refused = notice
    error = PipelineRefused(text) if refused else PeerFailedError(text)
    error.origin, error.notice = origin, message
    return error


class StageError(RuntimeError):
    """A stage raised: the message names rank, action (stage and micro-batch) and what it was
    given; the stage's own exception is the cause."""


class Failures:
    """The failure notices of one pipeline (store keys under ``prefix``)."""

    def __init__(self, group, rank: int, world_size: int, prefix: str) -> None:
        self.store = store_of(group)
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.posted = False

    def let_go(self) -> None:
        """Drop the store (the pipeline is closed or the interpreter exits), so that it is not
        left to the interpreter's teardown, which frees it in no defined order with what its
        threads use (``teardown``). Posting and reading then find no store, as when its host
        died."""
        del self.store

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/failed/{rank}"

    def post(self, origin: int, message: str, refused: bool = False) -> None:
        """Say (once) that this rank stops because rank ``origin`` failed with ``message``
        (``refused``: it refused the configuration)."""
        if self.posted:
            return
        self.posted = True
        try:
            self.store.set(self._key(self.rank), json.dumps([origin, message, refused]))
        except Exception:  # the store went with a dead rank 0: the closed connection still tells
            pass

    def read(self, wait: timedelta = timedelta(seconds=1)) -> dict[int, Notice]:
        """Every notice posted within ``wait`` (rank -> (origin, message, refused))."""
        found: dict[int, Notice] = {}
        deadline = time.monotonic() + wait.total_seconds()
        while True:
            for r in range(self.world_size):
                if r == self.rank or r in found:
                    continue
                try:
                    if self.store.check([self._key(r)]):
                        origin, message, refused = json.loads(self.store.get(self._key(r)))
                        found[r] = (origin, message, bool(refused))
                except Exception:
                    return found  # the store is gone with its host
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.05)

    def explain(
        self, what: str, peer: int, error: Exception, notices: dict[int, Notice]
    ) -> PeerFailedError | PipelineRefused:
        """The error for ``what`` (a wait on rank ``peer``) that failed with ``error``, given the
        ``notices`` read: the first failing rank and its message (``peer_error``), or the
        closed connection."""
        if notices:
            notice = first_notice(notices)
            text = f"{what} stopped because rank {notice[0]} failed: {notice[1]}"
            return peer_error(text, notice)
        found = PeerFailedError(
            f"{what}: rank {peer} closed the connection (it failed or exited before saying why; "
            f"see its log): {error}"
        )
        found.origin = peer
        return found


def closed_connection(error: Exception) -> bool:
    """Whether a transfer failed because the peer closed its end (not a timeout)."""
    text = str(error).lower()
    return "connection closed" in text or "connection reset" in text or "broken pipe" in text


def destroy_group(group) -> None:
    """Destroy a process group pipetrain made, if it is still there (idempotent, never raises)."""
    if group is None or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # already destroyed (destroy_process_group() of everything, or a failure)
        pass


class OwnedGroup:
    """A process group a pipeline made for itself, destroyed once (``release``): on close, on a
    failure (closing its connections tells every peer at once) and at interpreter exit, while
    Python still runs, so no transfer state of the pipeline's is left for the interpreter's
    teardown to free."""

    def __init__(self, group) -> None:
        self.group = group

    @staticmethod
    def transfer_group(group, timeout: timedelta) -> OwnedGroup:
        """On gloo with the default group, a new group of all ranks for the pipeline's transfers;
        elsewhere none. NCCL: another communicator costs device memory, and its failures surface
        through its own watchdog. A group the caller passed: ``new_group`` would need every rank
        of the world to call it (or, with local synchronisation, names every group of the same
        ranks alike, so a second pipeline would meet the first one's rendezvous); there the
        transfers stay on the caller's group and a failure reaches the peers as a notice they
        read when their wait ends (``timeout``)."""
        if group is not None or dist.get_world_size() < 2 or dist.get_backend() != "gloo":
            return OwnedGroup(None)
        return OwnedGroup(dist.new_group(timeout=timeout, backend="gloo"))

    def release(self, *holders: Any) -> None:
        """Destroy the group, and have each holder (the transport, the failure notices, the
        agreement) let go of its groups and stores while Python still runs."""
        group, self.group = self.group, None
        destroy_group(group)
        for holder in holders:
            holder.let_go()


def posts_failures(
    phases: Sequence[tuple[str, str]],
) -> Callable[[Callable[Concatenate[Built, P], None]], Callable[Concatenate[Built, P], None]]:
    """Construction failing on this rank: post a notice naming the phase it failed in, so peers
    waiting to agree stop now and say what really failed (once the object has its
    ``_failures``, and with it its ``rank``). ``phases``: (attribute, phase) in construction
    order; the phase is the first whose attribute is not made yet. A ``ValueError`` is a
    refusal: raised as ``PipelineRefused`` (its message unchanged, the original its cause) and
    marked so in the notice, so that the peers raise ``PipelineRefused`` too."""

    def decorate(
        init: Callable[Concatenate[Built, P], None],
    ) -> Callable[Concatenate[Built, P], None]:
        @functools.wraps(init)
        def wrapper(self: Built, *args: P.args, **kwargs: P.kwargs) -> None:
            try:
                init(self, *args, **kwargs)
            except BaseException as e:
                state = vars(self)
                failures = state.get("_failures")
                refused = isinstance(e, ValueError)  # a refusal here or a peer's
                if failures is not None:
                    origin = getattr(e, "origin", state["rank"])
                    phase = next((p for a, p in phases if a not in state), "finishing")
                    failures.post(origin, notice_of(e, phase), refused)
                if refused and not isinstance(e, PipelineRefused):
                    raise PipelineRefused(str(e)) from e
                raise

        return wrapper

    return decorate


class Stoppable(Protocol):
    def _stop_after(self, error: BaseException) -> None: ...


Stops = TypeVar("Stops", bound=Stoppable)


def stops_on_failure(
    step: Callable[Concatenate[Stops, P], R],
) -> Callable[Concatenate[Stops, P], R]:
    """A step that raises stops the pipeline on every rank (the pipeline's ``_stop_after``)."""

    @functools.wraps(step)
    def wrapper(self: Stops, *args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return step(self, *args, **kwargs)
        except BaseException as e:
            self._stop_after(e)
            raise

    return wrapper
