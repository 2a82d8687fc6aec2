"""Two lanes per F&B pair: an overlapped pair's forward on a second host thread, its backward on
the calling thread, joined before the next action (DualPipe's overlap, DeepSeek-V3 §3.2.1).

Why a thread, not only a stream. A mixture-of-experts layer's dispatch needs its token counts on
the host (``.tolist()`` after the counts' all-to-all), and a collective call blocks its caller
until the peers join. Launched from one thread, the forward's all-to-all therefore waits in
front of the backward's work, whatever streams the kernels go to: nothing of it can hide under
the other micro-batch. With the forward on a lane of its own, one micro-batch's all-to-all (or
its host sync) runs while the other's attention, expert GEMMs or weight gradients run — on a
GPU each lane on its own stream, on a CPU as real concurrency too (torch's kernels and gloo's
waits release the GIL). Expert parallel gives each direction its own process group
(``runtime.parallel.expert_parallel``), so the two lanes' collectives never share one.

What runs where (``PairLanes.run``): on CUDA the side stream first waits for the calling
thread's stream (the received inputs are ordered there), the lane runs the forward on the side
stream, the caller the backward on its own, and after the join the caller's stream waits for the
side stream; the forward's outputs are marked used on the caller's stream (``record_stream``) so
the allocator never reuses them under a later read there, and its inputs are held until the join
(``keep``). The lane starts with the caller's grad mode, autocast state and device. An error in
either part is re-raised on the caller after the join (the forward's first, as program order
would have raised it), where the pipeline's failure machinery tells every peer; a join that
outlasts the pipeline's timeout is a ``PipelineTimeoutError`` rather than a hang.

When a pair runs on one thread instead (``sequential_reason``; logged once per reason):

* a dropout of this rank's stages that draws (training, ``p > 0``; checked per pair, so
  ``eval()`` between steps counts): keyed dropout (``runtime.dropout_rng``) forks and reseeds
  torch's global generators around each piece and unkeyed dropout draws from them, so two lanes
  would interleave one generator — masks would depend on thread timing;
* a stage recomputed as a whole (``whole_stage_recompute``): its recompute restores the global
  random state and runs its forward outside autograd's engine, where expert parallel would take
  the forward group the lane holds;
* both parts on one stage (no schedule here pairs those; its runner's state is per stage);
* tensor parallel (the stage's own collectives in both directions on one ``tp`` group), a step
  captured as a CUDA graph, host offload (its copy stream and saved-tensor hooks are per stage
  but its ordering assumes one thread): the pair keeps running as before lanes existed — on CUDA
  the forward launched on the side stream from the calling thread, then the backward.

The lanes are used for every pair when ``overlap_pairs=True``, dense models too: there the
forward overlaps the backward's compute and, on a GPU, the other direction's pipeline transfers.
Within a step nothing else a stage runs issues collectives (data parallel's wrappers sync after a
stage's last backward piece, after the join; transfers are posted by the caller between
actions). A model whose layers issue collectives of their own must give each direction its own
group, as expert parallel does, or keep ``overlap_pairs`` off.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch

from pipetrain.runtime.comm.p2p import PipelineTimeoutError
from pipetrain.runtime.dropout_rng import Site, find_sites
from pipetrain.runtime.extra_losses import Sink, Term

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from pipetrain.runtime.stage import StageRunner
    from pipetrain.schedule.action import Action

_log = logging.getLogger(__name__)


class LaneSink(Sink):
    """A pipeline's extra-loss sink (``runtime.extra_losses``) whose collecting list is the
    running thread's own: the lane's forward collects its micro-batch's terms while a per-layer
    recompute inside the caller's backward records nothing into them."""

    def __init__(self) -> None:
        self._local = threading.local()
        super().__init__()

    @property  # type: ignore[override]
    def active(self) -> list[Term] | None:
        return getattr(self._local, "active", None)

    @active.setter
    def active(self, terms: list[Term] | None) -> None:
        self._local.active = terms


class _Lane:
    """One daemon thread that runs submitted callables in order (a daemon: one left waiting on
    a failed peer never holds the process at exit)."""

    def __init__(self, name: str) -> None:
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while (item := self._work.get()) is not None:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as error:
                    future.set_exception(error)
            # hold nothing while idle: the work's references (the executor, its transport) must
            # go with the step, so that a failed pipeline's groups close when it lets them go
            del item, fn, future

    def submit(self, fn: Callable[[], None]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((fn, future))
        return future

    def close(self) -> None:
        self._work.put(None)


class PairLanes:
    """A pipeline's lanes for its F&B pairs (module docstring); ``close`` ends the lane."""

    def __init__(
        self,
        device: torch.device,
        timeout: timedelta,
        threaded: str | None = None,
        dropouts: Sequence[Site] = (),
    ) -> None:
        self.device = device
        #: the dropouts of this rank's stages (``dropout_rng.find_sites``), keyed or not
        self.dropouts = tuple(dropouts)
        self.timeout = timeout
        #: why pairs run on one thread for this pipeline's whole life (None: they use the lane)
        self.always_sequential = threaded
        cuda = device.type == "cuda"
        self.side_stream = torch.cuda.Stream(device) if cuda else None
        self._lane: _Lane | None = None
        self._logged: set[str] = set()
        if threaded is not None:
            _log.info("overlap_pairs: an F&B pair runs on one thread here: %s", threaded)

    @classmethod
    def build(
        cls,
        overlap_pairs: bool,
        device: torch.device,
        runners: Mapping[int, StageRunner],
        timeout: timedelta,
        mesh: DeviceMesh | None = None,
    ) -> PairLanes | None:
        """The lanes of a pipeline with ``overlap_pairs`` (None without) on ``device``, for its
        ``runners`` (their extra loss terms then collected per thread: ``LaneSink``) on ``mesh``
        (the pipeline's, for its tensor-parallel size)."""
        if not overlap_pairs:
            return None
        sink = LaneSink()
        for runner in runners.values():
            runner.use_sink(sink)
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        reason = None
        if mesh is not None and "tp" in names and mesh["tp"].size() > 1:
            reason = "tensor parallel's collectives share one group in both directions"
        elif any(r.captured for r in runners.values()):
            reason = "a captured CUDA graph is recorded from one thread"
        elif any(r.offload is not None for r in runners.values()):
            reason = "host offload orders its copies from one thread"
        dropouts = [site for r in runners.values() for site in find_sites(r.module)]
        return cls(device, timeout, reason, dropouts)

    def sequential_reason(
        self, parts: tuple[Action, ...], runners: Mapping[int, StageRunner]
    ) -> str | None:
        """Why this pair must run on one thread (None: it takes the lanes)."""
        forward, backward = parts
        if self.always_sequential is not None:
            return self.always_sequential
        if forward.stage == backward.stage:
            return "both parts are on one stage"
        if runners[backward.stage].recomputes_whole or runners[forward.stage].recomputes_whole:
            return "a stage recomputed as a whole restores the global random state"
        if any(site.active() for site in self.dropouts):
            return "dropout draws from torch's global generators, which two lanes would interleave"
        return None

    def note_sequential(self, reason: str) -> None:
        """Log ``reason`` once per pipeline."""
        if reason not in self._logged and reason != self.always_sequential:
            self._logged.add(reason)
            _log.info("overlap_pairs: F&B pairs run on one thread: %s", reason)

    def run(
        self,
        forward: Callable[[], None],
        backward: Callable[[], None],
        keep: object = None,
        outputs: Callable[[], Iterable[torch.Tensor]] = tuple,
    ) -> None:
        """``forward`` on the lane, ``backward`` here, both finished on return; ``keep``
        referenced until the join; ``outputs()`` (after the join) the forward's tensors the
        caller's stream reads later."""
        main = torch.cuda.current_stream(self.device) if self.side_stream is not None else None
        if main is not None:
            self.side_stream.wait_stream(main)  # type: ignore[union-attr]
        if self._lane is None:
            self._lane = _Lane(f"pipetrain pair lane ({self.device})")
        future = self._lane.submit(self._carried(forward))
        failed: BaseException | None = None
        try:
            backward()
        except BaseException as error:
            failed = error
        lane_failed = self._join(future)
        if main is not None:
            main.wait_stream(self.side_stream)  # type: ignore[arg-type]
            for t in outputs():
                t.record_stream(main)
        del keep
        if lane_failed is not None:
            raise lane_failed
        if failed is not None:
            raise failed

    def _join(self, future: concurrent.futures.Future) -> BaseException | None:
        try:
            future.result(timeout=self.timeout.total_seconds())
        except concurrent.futures.TimeoutError:
            return PipelineTimeoutError(
                f"an F&B pair's forward did not finish within {self.timeout} on its lane "
                "(a collective waiting on a peer?)"
            )
        except BaseException as error:
            return error
        return None

    def _carried(self, fn: Callable[[], None]) -> Callable[[], None]:
        """``fn`` under the calling thread's grad mode, autocast state, device and (CUDA) the
        side stream: thread-local state a new thread would not have."""
        grad = torch.is_grad_enabled()
        kinds = {"cpu", self.device.type}
        casts = [(k, torch.get_autocast_dtype(k)) for k in kinds if torch.is_autocast_enabled(k)]
        stream, device = self.side_stream, self.device

        def run() -> None:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.set_grad_enabled(grad))
                for kind, dtype in casts:
                    stack.enter_context(torch.autocast(kind, dtype))
                if stream is not None:
                    stack.enter_context(torch.cuda.device(device))
                    stack.enter_context(torch.cuda.stream(stream))
                fn()

        return run

    def close(self) -> None:
        """End the lane (idempotent); a step in flight has joined it already."""
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.close()
        self.side_stream = None


def close_lanes(lanes: PairLanes | None) -> None:
    """``lanes.close()`` where there are lanes."""
    if lanes is not None:
        lanes.close()


__all__ = ["LaneSink", "PairLanes", "close_lanes"]
