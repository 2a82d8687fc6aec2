"""Whole-step CUDA graphs: a training step captured once and replayed (``Pipeline(cuda_graph=True)``).

A pipeline step of small actions is host-bound: every action is a few Python calls and dozens of
kernel launches, and the device idles while the host issues them. Captured as one CUDA graph
(``torch.cuda.CUDAGraph``), the step's kernels and transfers — forwards, backward pieces, the
NCCL sends and receives between stages, on every stream the step uses — are issued by one replay,
in the order the program gave them (as Megatron-Core's full-iteration graphs and torch's
whole-network capture do).

What stays outside the capture, run by the host every step: the batch copied into the graph's
static buffers, the shape agreement between ranks (a store write), the loss weights, handing the
step's gradients to ``.grad``; after the replay, the tied-gradient sum and the loss broadcast.
What the capture runs once: the executor's Python, which issues the step; its host checks and
Python hooks inside stages run at capture, never at replay.

A graph is valid for one *key*: input, target and side-input shapes and dtypes (non-tensor side
values by equality), every parameter's and buffer's storage and ``requires_grad``, every module's
training flag, grad mode and autocast state, and each ``.grad``'s storage (or ``None``). For a new
key the graph is dropped and the steps run eagerly ``WARMUP`` times — the first discovers transfer
shapes, the second runs the steady path once, so that lazy initialisation (cuBLAS workspaces, NCCL
connections, compiled kernels) happens outside a capture — and the next step captures on a stream
of its own (errors only for this thread: the process group's watchdog polls events meanwhile), then
replays.

Gradients: a replay leaves ``.grad`` as eager autograd would, holding one copy of them. A parameter
whose ``.grad`` is ``None`` at capture gets a buffer of the graph's own, written afresh by each
replay and handed over as its ``.grad`` (what ``AccumulateGrad`` does with a first gradient, so
``zero_grad()`` costs nothing); one whose ``.grad`` exists keeps it, and the captured step adds
into that tensor in place, as every backward path does where ``.grad`` exists (so a loop that keeps
``.grad`` between steps, ``zero_grad(set_to_none=False)`` or accumulation across steps, replays
into it). Which ``.grad`` exist, and their storage, are part of the key: where a step finds the
graph's buffers kept as ``.grad`` (``None`` became kept) it warms up and captures again, the
buffers copied out first so that the dropped graph's memory can go. The loss weights are a device
tensor the host refills, so ``"token_mean"`` weights may change every step.

``cuda_graph="timed"`` also records a timing event at the start and end of every action inside
the graph (``runtime.timing``: external events, one event-record node each), so that
``step(timeline=True)`` measures the replay: the same ``Timeline`` an eager step gives, without
the host.

Refused, never silently wrong or hanging: devices other than CUDA, data parallel, meshes,
offload and the allocator's expandable segments at construction (``check``); at a step,
``timeline=True`` on a graph captured without timing events (``cuda_graph=True``: one replay
has no per-action spans), targets that are not tensors, and
parameters with post-accumulate-grad hooks (a replay would not run them); at capture, a step that
replaces an existing ``.grad`` instead of adding into it (a replay would not accumulate).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from pipetrain.runtime.microbatch import MicroBatches
from pipetrain.runtime.timing import Recorder
from pipetrain.runtime.torch_compat import copy_lists_, post_accumulate_grad_hooks

if TYPE_CHECKING:
    from pipetrain.runtime.comm.agreement import Agreement

_log = logging.getLogger(__name__)

#: eager steps before a capture, per key: shape discovery, then the steady path once
WARMUP = 2
#: ``Pipeline(cuda_graph=...)``'s legal values: eager, captured, captured with timing events
MODES = (False, True, "timed")

Side = tuple[dict[str, object], ...]
#: ``execute(mbs, side)``: run the step's actions on these micro-batches (eagerly, or captured)
Execute = Callable[[MicroBatches, Side], object]


#: the allocator settings variables: with expandable segments, a replayed step's NCCL transfers
#: never completed (GPT in bfloat16 on 2 and 4 GPUs: every rank waited in the loss broadcast after
#: the first replay), so a captured step refuses them (docs/runtime.md)
ALLOCATOR_SETTINGS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def expandable_segments() -> bool:
    """Whether the caching allocator is configured with expandable segments (its settings
    variable, as torch reads it at its first CUDA allocation)."""
    for name in ALLOCATOR_SETTINGS:
        settings = os.environ.get(name, "").replace(" ", "").lower()
        if "expandable_segments:true" in settings:
            return True
    return False


def check(
    enabled: bool | str,
    device: torch.device,
    data_parallel: object,
    mesh: object,
    offload: Sequence[float] | None,
) -> None:
    """Refuse at construction what a captured step cannot run exactly, or is not verified on
    (``offload``: the per-stage fractions; all zero is no offload)."""
    if enabled not in MODES:
        raise ValueError(f"cuda_graph must be one of False, True, 'timed'; got {enabled!r}")
    if not enabled:
        return
    if device.type != "cuda":
        raise ValueError(
            f"cuda_graph=True captures the step on a CUDA device; this pipeline runs on "
            f"{device.type} (pass cuda_graph=False)"
        )
    if expandable_segments():
        raise ValueError(
            "cuda_graph=True is verified with the caching allocator's default segments; "
            "expandable_segments:True is set (PYTORCH_CUDA_ALLOC_CONF), with which a replayed "
            "step's NCCL transfers never complete; unset it or pass cuda_graph=False"
        )
    moves = offload is not None and any(f > 0 for f in offload)
    refused = {"data_parallel": data_parallel, "mesh": mesh, "offload": moves}
    given = [name for name, value in refused.items() if value]
    if given:
        again = (
            " (a plan that offloads: plan again with `pipetrain plan --cuda-graph`)"
            if moves
            else ""
        )
        raise ValueError(
            f"cuda_graph=True with {', '.join(given)} is not supported yet (their gradient "
            f"syncs and copies keep host-side state per step); pass cuda_graph=False{again}"
        )


def check_step(graph: StepGraph | None, timeline: bool) -> None:
    if graph is not None and timeline and graph.recorder is None:
        raise ValueError(
            "timeline=True measures each action, but a step captured with cuda_graph=True "
            "replays as one; build the Pipeline with cuda_graph='timed' (timing events inside "
            "the graph) or cuda_graph=False"
        )


def build(
    enabled: bool | str,
    device: torch.device,
    modules: Iterable[nn.Module],
    losses: dict[int, torch.Tensor] | None,
    rank: int,
) -> StepGraph | None:
    """The pipeline's step graph where ``cuda_graph`` is ``True`` or ``"timed"`` (``check``
    passed), else ``None``."""
    if not enabled:
        return None
    recorder = Recorder(rank, device, True, captured=True) if enabled == "timed" else None
    return StepGraph(device, list(modules), losses, recorder)


class StepGraph:
    """One captured training step of this rank's ``modules`` (see the module docstring).

    ``losses``: the last stage's per-micro-batch losses (its runner's ``losses``), on the rank
    that holds it: refilled after each replay with the tensors the graph writes."""

    def __init__(
        self,
        device: torch.device,
        modules: Sequence[nn.Module],
        losses: dict[int, torch.Tensor] | None,
        recorder: Recorder | None = None,
    ) -> None:
        self.device = device
        self.modules = list(modules)
        self.losses = losses
        #: ``cuda_graph="timed"``: what records the actions' events at capture
        self.recorder = recorder
        self.params = _unique(p for m in self.modules for p in m.parameters())
        self.buffers = _unique(b for m in self.modules for b in m.buffers())
        self.stream: torch.cuda.Stream | None = None  # made at the first capture
        self._key: Hashable = None
        self._eager_left = WARMUP
        self._graph: torch.cuda.CUDAGraph | None = None
        self._statics: list[torch.Tensor] = []  # the graph reads inputs, targets and side here
        self._sources: dict[int, int] = {}  # id of a step's tensor -> its index in _statics
        self._weights = torch.zeros(0, dtype=torch.float64, device=device)
        self._weights_now: tuple[float, ...] = ()
        self._grads: dict[nn.Parameter, torch.Tensor] = {}  # the graph's gradient buffers
        self._captured_losses: dict[int, torch.Tensor] = {}
        #: replays so far (tests and benchmarks read it: a step that should replay did)
        self.replays = 0
        self._at_exit: Callable[[], None] | None = None  # registered with atexit at capture

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def capturing_recorder(self) -> Recorder | None:
        """The recorder a step's actions record into while it is being captured (a timed
        graph's), else ``None``."""
        timed = self.recorder is not None and self.device.type == "cuda"
        capturing = timed and torch.cuda.is_current_stream_capturing()
        return self.recorder if capturing else None

    def release(self, synchronize: bool = False) -> None:
        """Drop the graph and its buffers. NCCL does not destroy a communicator that a live
        graph holds transfers of (``destroy_process_group`` waits forever), so the pipeline
        releases its graph before its groups: on ``close`` (``synchronize``: after the last
        replay ends), and at exit ahead of the groups' teardown (registered at capture;
        ``atexit`` runs last in first). The exit hook holds the graph weakly: a pipeline
        dropped before ``destroy_process_group`` takes its graph with it."""
        if self._graph is None:
            return
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if synchronize:
            torch.cuda.synchronize(self.device)
        self._graph = None
        self._key, self._statics, self._sources = None, [], {}
        self._grads, self._captured_losses = {}, {}

    def step(
        self,
        mbs: MicroBatches,
        side: Side,
        announce: Callable[[], None],
        run: Execute,
        agreement: Agreement | None = None,
        before_replay: Callable[[], None] | None = None,
    ) -> str:
        """Run one training step: eagerly while warming up, else (capturing first) a replay;
        returns which (``"eager"``, ``"capture"``, ``"replay"``). ``before_replay``: what the
        host does right before the replay (lines the ranks up for a timed one).
        ``announce`` is what the host does every step before the actions (the agreement);
        ``run`` runs the actions and announces itself. ``agreement``: told how this step runs
        (announced to the peers), and met after a capture (``Agreement.captured``): a rank whose
        capture failed never replays, and a peer that replayed would wait on the device for its
        transfers for good; meeting first, the peer hears of the failure instead."""
        key = self._key_of(mbs, side)
        if key != self._key:
            if self._graph is not None:
                _log.info("cuda_graph: the step changed (shapes, storage or modes); recapturing")
                self._copy_out_buffers()
                self.release()
                key = self._key_of(mbs, side)  # the copies' storage
            self._key, self._eager_left = key, WARMUP
        how = "replay" if self._graph is not None else "eager" if self._eager_left else "capture"
        if agreement is not None:
            agreement.graph_step = how
        if how == "eager":
            self._eager_left -= 1
            run(mbs, side)
            return how
        if how == "capture":
            self._capture(mbs, side, run)
            if agreement is not None:
                agreement.captured()
        else:
            self._fill(mbs, side)
            announce()
        if before_replay is not None:
            before_replay()
        self._replay()
        return how

    # -- the key ----------------------------------------------------------------------------------

    def _key_of(self, mbs: MicroBatches, side: Side) -> Hashable:
        tensors = [(tuple(t.shape), t.dtype) for t in self._tensors_of(mbs, side)]
        constants = tuple(
            (name, _constant(name, v))
            for d in side
            for name, v in d.items()
            if not isinstance(v, torch.Tensor)
        )
        state = tuple(
            (p.data_ptr(), p.requires_grad, None if p.grad is None else p.grad.data_ptr())
            for p in self.params
        )
        buffers = tuple(b.data_ptr() for b in self.buffers)
        training = tuple(m.training for top in self.modules for m in top.modules())
        autocast = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        modes = (torch.is_grad_enabled(), autocast, len(mbs.weights))
        return (tuple(tensors), constants, state, buffers, training, modes)

    def _tensors_of(self, mbs: MicroBatches, side: Side) -> list[torch.Tensor]:
        """Every tensor the step reads from its batch, each once, in a fixed order."""
        inputs = [t for args in mbs.inputs for t in args]
        targets = [t for target in mbs.targets for t in _target_tensors(target)]
        sides = [v for d in side for v in d.values() if isinstance(v, torch.Tensor)]
        return _unique([*inputs, *targets, *sides])

    # -- capture and replay -----------------------------------------------------------------------

    def _capture(self, mbs: MicroBatches, side: Side, run: Execute) -> None:
        hooked = [p for p in self.params if post_accumulate_grad_hooks(p)]
        if hooked:
            raise ValueError(
                f"cuda_graph=True: {len(hooked)} parameter(s) have post-accumulate-grad hooks, "
                "which a replayed step would not run; remove them or pass cuda_graph=False"
            )
        sources = self._tensors_of(mbs, side)
        self._statics = [t.detach().clone() for t in sources]
        self._sources = {id(t): i for i, t in enumerate(sources)}
        self._weights = torch.tensor(mbs.weights, dtype=torch.float64, device=self.device)
        self._weights_now = tuple(mbs.weights)
        static_mbs, static_side = self._static_view(mbs, side)
        prior = {p: p.grad for p in self.params}
        graph = torch.cuda.CUDAGraph()
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                run(static_mbs, static_side)
            replaced = [p for p, g in prior.items() if g is not None and p.grad is not g]
            if replaced:
                raise ValueError(
                    f"cuda_graph=True: the step replaced {len(replaced)} existing .grad tensor(s) "
                    "instead of adding into them, so a replay would not accumulate; remove what "
                    "assigns .grad inside the step or pass cuda_graph=False"
                )
            self._grads = {p: p.grad for p, g in prior.items() if g is None and p.grad is not None}
        except RuntimeError as e:  # a StageError too: it names the action
            if "captur" not in str(e).lower():
                raise
            raise ValueError(
                "cuda_graph=True: the step could not be captured — something in it waits for the "
                "host (.item(), .cpu(), a shape that depends on data) or is not capturable; pass "
                f"cuda_graph=False. {type(e).__name__}: {e}"
            ) from e
        finally:
            for p in self.params:
                p.grad = prior[p]
        self._captured_losses = dict(self.losses) if self.losses is not None else {}
        if self.losses is not None:
            self.losses.clear()
        self._graph = graph
        self._at_exit = _release_at_exit(self)
        atexit.register(self._at_exit)
        _log.info("cuda_graph: step captured (%d gradient buffers)", len(self._grads))

    def _static_view(self, mbs: MicroBatches, side: Side) -> tuple[MicroBatches, Side]:
        """``mbs`` and ``side`` with every tensor replaced by its static buffer, and the loss
        weights by views of the weights tensor."""

        def static(t: torch.Tensor) -> torch.Tensor:
            return self._statics[self._sources[id(t)]]

        inputs = tuple(tuple(static(t) for t in args) for args in mbs.inputs)
        targets = tuple(_map_target(target, static) for target in mbs.targets)
        # device tensors the host refills (the executor multiplies by them as by floats)
        weights = cast(tuple[float, ...], tuple(self._weights[j] for j in range(len(mbs.weights))))
        static_side = tuple({name: _rewrap(v, static) for name, v in d.items()} for d in side)
        mbs = dataclasses.replace(mbs, inputs=inputs, targets=targets, weights=weights)
        return mbs, static_side

    def _fill(self, mbs: MicroBatches, side: Side) -> None:
        """This step's batch into the static buffers (one launch) and its weights, if new."""
        copy_lists_(self._statics, self._tensors_of(mbs, side))
        if tuple(mbs.weights) != self._weights_now:
            self._weights.copy_(torch.tensor(mbs.weights, dtype=torch.float64))
            self._weights_now = tuple(mbs.weights)

    def _replay(self) -> None:
        assert self._graph is not None, "replay before capture"
        self._graph.replay()
        self.replays += 1
        # the key holds these .grad at None; the others the graph added into in place
        for p, buffer in self._grads.items():
            p.grad = buffer
        if self.losses is not None:
            self.losses.update(self._captured_losses)

    def _copy_out_buffers(self) -> None:
        """Give each ``.grad`` that is one of the graph's buffers a copy of its own (one at a
        time: a buffer goes as its copy comes), so that no live tensor keeps the dropped graph's
        memory pool."""
        for p in list(self._grads):
            buffer = self._grads.pop(p)
            if p.grad is buffer:
                p.grad = buffer.clone()
            del buffer


def _unique(tensors) -> list:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _target_tensors(target: object) -> list[torch.Tensor]:
    if target is None:
        return []
    if isinstance(target, torch.Tensor):
        return [target]
    if isinstance(target, tuple) and all(isinstance(t, torch.Tensor) for t in target):
        return list(target)
    raise ValueError(
        f"cuda_graph=True needs targets as tensors (or None); a captured step cannot see a new "
        f"{type(target).__name__} at each replay"
    )


def _map_target(target: object, static: Callable[[torch.Tensor], torch.Tensor]) -> object:
    if isinstance(target, torch.Tensor):
        return static(target)
    if isinstance(target, tuple):
        return tuple(static(t) for t in target)
    return target


def _rewrap(value: object, static: Callable[[torch.Tensor], torch.Tensor]) -> object:
    return static(value) if isinstance(value, torch.Tensor) else value


def _constant(name: str, value: object) -> Hashable:
    """A non-tensor side value, compared step to step: the capture baked it in."""
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            f"cuda_graph=True: side input {name!r} is a {type(value).__name__}, which a captured "
            "step cannot compare from step to step; pass a tensor or a hashable constant"
        ) from None
    return (type(value).__name__, value)


def _release_at_exit(graph: StepGraph) -> Callable[[], None]:
    """An exit hook that releases ``graph`` if it is still alive, without keeping it alive."""
    ref = weakref.ref(graph)

    def release() -> None:
        alive = ref()
        if alive is not None:
            alive.release()

    return release
