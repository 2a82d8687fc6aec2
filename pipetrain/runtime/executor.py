"""The executor: runs one rank's row of a lowered program, one exhaustive ``match`` on op kinds.

It owns the values in flight between actions, keyed by (stage, micro-batch): activations waiting
for their ``F`` (received, or handed over by a local previous stage), outputs waiting for their
``SEND_F``, output gradients waiting for their ``B``/``I``, input gradients waiting for their
``SEND_B``. Consecutive SEND/RECV actions are posted together (``p2p.Transport.post``) just
before the next compute action (receives posted at their position in the program, waited only by
the compute that reads them). Every entry is popped by the action that consumes it, so a step that completes leaves all
of them empty — ``check_empty`` holds the runtime to that.

While a torch profiler records, each action runs inside ``record_function`` with its label
(``profile_label``: ``F 3 mb 5``, ``SEND_B 2 mb 0``), so a user's own trace shows the schedule; a
compute action's label excludes its wait for inputs, as its span does, and a transfer's covers
its posting.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import record_function

from pipetrain.runtime.comm.failures import PeerFailedError, PipelineRefused, StageError
from pipetrain.runtime.comm.p2p import (
    Pending,
    PipelineTimeoutError,
    TensorMeta,
    Transport,
    recv_buffer,
    wire,
)
from pipetrain.runtime.dropout_rng import DropoutKeys
from pipetrain.runtime.pair_lanes import PairLanes
from pipetrain.runtime.stage import StageRunner, leaves
from pipetrain.runtime.timing import Recorder
from pipetrain.runtime.torch_compat import profiler_enabled
from pipetrain.schedule import deps
from pipetrain.schedule.action import COPY_KINDS, Action, OpKind
from pipetrain.schedule.placement import Placement

Key = tuple[int, int]


@dataclass(frozen=True)
class StepData:
    """This step's micro-batches: stage-0 inputs, targets and loss weights."""

    inputs: tuple[tuple[torch.Tensor, ...], ...]
    targets: tuple[object, ...]
    weights: tuple[float, ...]
    side: tuple[dict[str, object], ...] = ()  # per micro-batch (``runtime.side_inputs``)


@dataclass
class MetaCache:
    """Forward transfer metadata learnt while discovering; valid while input shapes stay."""

    signature: object = None
    received: dict[Key, tuple[TensorMeta, ...]] = field(default_factory=dict)
    sent: dict[Key, tuple[TensorMeta, ...]] = field(default_factory=dict)


def cache_for(caches: dict[str, MetaCache], mode: str, signature: object) -> tuple[MetaCache, bool]:
    """The transfer metadata of ``mode``'s steps, and whether this step must discover it again
    (the first step, or new input shapes: a new, empty cache)."""
    cache = caches.get(mode)
    if cache is not None and cache.signature == signature:
        return cache, False
    logging.getLogger(__name__).debug(
        "%s: new input shapes %s, transfer shapes learnt", mode, signature
    )
    caches[mode] = MetaCache(signature=signature)
    return caches[mode], True


class Executor:
    """Runs this rank's actions for one step (``train``) or one forward-only pass."""

    def __init__(
        self,
        rank: int,
        placement: Placement,
        runners: dict[int, StageRunner],
        transport: Transport,
        arities: list[tuple[int, float]],
        lanes: PairLanes | None = None,
        after_compute: Callable[[Action], None] | None = None,
        keys: DropoutKeys | None = None,
    ) -> None:
        self.rank = rank
        #: dropout keyed per (step, micro-batch, layer) around each compute piece
        #: (``runtime.dropout_rng``; None: torch's global stream)
        self.keys = keys
        #: called after each compute action, once the transfers posted after it are out (the
        #: pipeline's data-parallel sync hangs on it)
        self.after_compute = after_compute
        #: where an F&B pair's parts run (``runtime.pair_lanes``; None: one after the other)
        self.lanes = lanes
        self._local = threading.local()  # what the running thread's compute was given
        self.placement = placement
        self.runners = runners
        self.transport = transport
        self.arities = arities
        self.acts: dict[Key, tuple[torch.Tensor, ...] | Pending] = {}
        self.outbox_f: dict[Key, tuple[torch.Tensor, ...]] = {}
        self.grads: dict[Key, list[torch.Tensor] | Pending] = {}
        self.outbox_b: dict[Key, list[torch.Tensor]] = {}
        self.results: dict[int, tuple[torch.Tensor, ...]] = {}
        self._batch: list[tuple[str, Pending, torch.Tensor]] = []

    def run(
        self,
        actions: tuple[Action, ...],
        data: StepData,
        cache: MetaCache,
        recorder: Recorder,
        train: bool,
        discover: bool,
    ) -> None:
        """Execute ``actions`` in order; with ``discover``, learn transfer shapes into ``cache``."""
        self.data, self.cache, self.train, self.discover = data, cache, train, discover
        try:
            self._run(actions, recorder)
        except BaseException:
            self.abandon()
            raise

    def _run(self, actions: tuple[Action, ...], recorder: Recorder) -> None:
        done = None  # the last compute action, handed to ``after_compute`` once its sends are out
        for action in actions:
            if action.kind in COPY_KINDS:  # issued on the stage's copy stream, not timed
                self.dispatch(action)
            elif not action.is_comm:
                self.flush()
                self._after(done)
                self.transport.reap()
                # Waiting for inputs is idle time, not the action's: the span starts after it.
                self.resolve_inputs(action)
                started = recorder.start()
                with _labelled(action):
                    self.compute(action)
                recorder.stop(action, started)
                done = action
            else:
                with _labelled(action):
                    self.dispatch(action)
                if self.discover:
                    self.flush()
        self.flush()
        self._after(done)
        self.transport.drain()

    def _after(self, action: Action | None) -> None:
        if action is not None and self.after_compute is not None:
            self.after_compute(action)

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        self.transport.post(batch)

    def compute(self, action: Action) -> None:
        """A compute action; an error inside a stage is re-raised naming stage, micro-batch,
        action and the tensors it was given."""
        self._given = None
        try:
            self.dispatch(action)
        except (PeerFailedError, PipelineRefused, PipelineTimeoutError, StageError):
            raise
        except Exception as e:
            raise StageError(self._describe(action, e)) from e

    def _describe(self, action: Action, error: Exception) -> str:
        text = (
            f"rank {self.rank}: stage {action.stage}, micro-batch {action.microbatch}, action "
            f"{action.kind.name} ({action}) failed: {type(error).__name__}: {error}"
        )
        if self._given is not None:
            what, metas = self._given
            text += f"; {what}: {_show(metas)}"
            s = action.stage
            shapes = any(word in str(error) for word in ("shape", "size"))
            if shapes and what.startswith("stage") and " received" in what:
                takes = _first_layer_takes(self.runners[s].module)
                if takes:
                    text += f"; stage {s}'s {takes}"
        return text

    def dispatch(self, action: Action) -> None:
        s, j = action.stage, action.microbatch
        match action.kind:
            case OpKind.F:
                with self._keyed(j):
                    self.forward(s, j)
            case OpKind.B | OpKind.I:
                with self._keyed(j):  # a recompute draws the forward's masks again
                    self.backward(action)
            case OpKind.W:
                with self._keyed(j):
                    self.runners[s].backward_weight(j)
            case OpKind.OVERLAP_F_B:
                self.overlapped(action)
            case OpKind.SEND_F:
                self.send(action, self.outbox_f.pop((s, j)), self._peer_rank(action))
            case OpKind.RECV_F:
                self.recv_f(action)
            case OpKind.SEND_B:
                self.send(action, self.outbox_b.pop((s, j)), self._peer_rank(action))
            case OpKind.RECV_B:
                metas = tuple(self.runners[s].grad_metas(j))
                self.recv(action, self._peer_rank(action), metas, self.grads)
            case OpKind.OFFLOAD | OpKind.RELOAD:
                offload = self.runners[s].offload
                assert offload is not None, f"{action}: stage {s} has no offload"
                (offload.offload if action.kind is OpKind.OFFLOAD else offload.reload)(j)

    def _keyed(self, microbatch: int) -> AbstractContextManager[object]:
        return contextlib.nullcontext() if self.keys is None else self.keys.running(microbatch)

    @property
    def _given(self) -> tuple[str, tuple[TensorMeta, ...]] | None:
        """What the running thread's compute piece was given (an error names it): per thread,
        since a pair's two lanes compute at once."""
        return getattr(self._local, "given", None)

    @_given.setter
    def _given(self, value: tuple[str, tuple[TensorMeta, ...]] | None) -> None:
        self._local.given = value

    def overlapped(self, action: Action) -> None:
        """An F&B pair: without lanes one part after the other; with them (``overlap_pairs``) the
        forward on the pipeline's lane while the backward runs here (``runtime.pair_lanes``),
        or, where a pair must stay on one thread, as before lanes existed.

        One thread on CUDA: the forward is launched on the side stream, the backward on the
        current one; the side stream first waits for the current one (received inputs are ordered
        there), and the current one waits for it at the end, so whatever follows — sends, the
        next stage — sees the forward's outputs. Autograd runs the forward's backward later on
        the stream it was recorded on and synchronises with the caller's, as torch documents.
        """
        forward, backward = action.parts
        lanes = self.lanes
        if lanes is None:
            self.dispatch(forward)
            self.dispatch(backward)
            return
        why = lanes.sequential_reason(action.parts, self.runners)
        if why is None:
            inputs = self.acts.get((forward.stage, forward.microbatch))
            # each part's error names that part and what it was given (``compute``)
            first, second = (functools.partial(self.compute, part) for part in action.parts)
            made = functools.partial(self._made_by, forward)
            lanes.run(first, second, keep=inputs, outputs=made)
            return
        lanes.note_sequential(why)
        side = lanes.side_stream
        if side is None:
            self.dispatch(forward)
            self.dispatch(backward)
            return
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            self.dispatch(forward)
        self.dispatch(backward)
        main.wait_stream(side)

    def _made_by(self, forward: Action) -> list[torch.Tensor]:
        """The tensors ``forward`` left for later actions (to send, or for the next local
        stage or the results)."""
        s, j = forward.stage, forward.microbatch
        nxt = self._next_stage(s)
        handed = self.acts.get((nxt, j)) if nxt is not None else None
        found = [self.outbox_f.get((s, j)), self.results.get(j), handed]
        return [t for held in found if isinstance(held, tuple) for t in held]

    # Where values go is the dependency rule's to say (``schedule.deps``), not this module's.
    def _peer_rank(self, action: Action) -> int:
        return self.placement.rank(deps.peer(action).stage)

    def _next_stage(self, stage: int) -> int | None:
        """The stage that consumes ``stage``'s output (None: the last stage)."""
        key = (deps.Token.ACTIVATION, stage, 0)
        return deps.consumer_stage(key, self.placement.stages_per_chain)

    def _previous_stage(self, stage: int) -> int | None:
        """The stage that consumes ``stage``'s input gradient (None: the first stage)."""
        key = (deps.Token.INPUT_GRAD, stage, 0)
        return deps.consumer_stage(key, self.placement.stages_per_chain)

    def resolve_inputs(self, action: Action) -> None:
        """Wait for the received values ``action`` reads, so its own span excludes the wait."""
        for part in action.compute_parts:
            key = (part.stage, part.microbatch)
            if part.kind is OpKind.F:
                pending = self.acts.get(key)
                if isinstance(pending, Pending):
                    self.acts[key] = self._take(pending)
            elif part.kind in (OpKind.B, OpKind.I):
                waiting = self.grads.get(key)
                if isinstance(waiting, Pending):
                    self.grads[key] = self._take(waiting)

    def forward(self, s: int, j: int) -> None:
        first = self._previous_stage(s) is None
        args = self.data.inputs[j] if first else self._take(self.acts.pop((s, j)))
        source = "inputs" if first else "activations"
        self._given = (f"stage {s} received {source}", tuple(TensorMeta.of(a) for a in args))
        self._check_arity(s, len(args), "receives")
        runner = self.runners[s]
        side = self.data.side[j] if self.data.side else None
        if self.train:
            outputs = runner.forward(j, args, self.data.targets[j], self.data.weights[j], side)
        else:
            outputs = runner.call(args, side)
        if runner.is_last:
            if not self.train:
                self.results[j] = outputs
            return
        nxt = self._next_stage(s)
        assert nxt is not None, f"stage {s} is not the last, so its output has a consumer"
        self._check_arity(nxt, len(outputs), "would receive")
        if self.placement.rank(nxt) == self.rank:
            self.acts[(nxt, j)] = leaves(outputs)
        else:
            self.outbox_f[(s, j)] = outputs

    def backward(self, action: Action) -> None:
        s, j = action.stage, action.microbatch
        runner = self.runners[s]
        grads = None if runner.is_last else self._take(self.grads.pop((s, j)))
        if grads is not None:
            metas = tuple(TensorMeta.of(g) for g in grads)
            expected = _show(tuple(runner.grad_metas(j)))
            self._given = (f"output gradients arrived (its outputs were {expected})", metas)
        if action.kind is OpKind.B:
            found = runner.backward(j, grads)
        else:
            found = runner.backward_input(j, grads)
        prev = self._previous_stage(s)
        if prev is None:
            return
        if self.placement.rank(prev) == self.rank:
            self.grads[(prev, j)] = found
        else:
            self.outbox_b[(s, j)] = found

    def send(self, action: Action, tensors, peer: int) -> None:
        tensors = tuple(tensors)
        if action.kind is OpKind.SEND_F:
            self._check_sent_meta(action, tuple(TensorMeta.of(t) for t in tensors), peer)
        wires = [wire(t) for t in tensors]
        owner = Pending(action, peer, wires, [])
        self._batch += [("send", owner, w) for w in wires]

    def recv_f(self, action: Action) -> None:
        key, peer = (action.stage, action.microbatch), self._peer_rank(action)
        if self.discover:
            self.cache.received[key] = self.transport.recv_meta(action, peer)
        metas = self.cache.received.get(key)
        assert metas is not None, f"no metadata for {action} outside discovery"
        self.recv(action, peer, metas, self.acts)

    def recv(self, action: Action, peer: int, metas, into: dict) -> None:
        buffers = [recv_buffer(m, self.transport.device) for m in metas]
        owner = Pending(action, peer, buffers, [], metas)
        self._batch += [("recv", owner, b) for b in buffers]
        into[(action.stage, action.microbatch)] = owner

    def _take(self, value):
        """A received value ready for compute: wait for it, then make leaves of activations."""
        if not isinstance(value, Pending):
            return value
        self.transport.wait(value)
        tensors = value.tensors()
        if value.action.kind is OpKind.RECV_B:
            return tensors
        grad = [self.train and m.requires_grad for m in value.metas]
        return tuple(t.requires_grad_(g) for t, g in zip(tensors, grad))

    def _check_sent_meta(self, action: Action, metas: tuple[TensorMeta, ...], peer: int) -> None:
        key = (action.stage, action.microbatch)
        if self.discover:
            self.cache.sent[key] = metas
            self.transport.send_meta(action, peer, metas)
        elif self.cache.sent.get(key) != metas:
            raise ValueError(
                f"rank {self.rank}: {action} sends {metas}, but the first step with these input "
                f"shapes sent {self.cache.sent.get(key)}; stage outputs whose shapes change "
                "while the inputs' shapes stay are not supported"
            )

    def _check_arity(self, stage: int, count: int, verb: str) -> None:
        lo, hi = self.arities[stage]
        if not lo <= count <= hi:
            most = "any number" if hi == math.inf else int(hi)
            raise ValueError(
                f"stage {stage} {verb} {count} tensor(s) but its forward takes {lo} to {most} "
                f"positional arguments; make stage {stage - 1}'s outputs match stage {stage}'s "
                "inputs (a tuple output is passed as positional arguments)"
            )

    def abandon(self) -> None:
        """Drop every value in flight (a failed step): no transfer of it may stay referenced."""
        for table in (self.acts, self.outbox_f, self.grads, self.outbox_b):
            table.clear()
        self._batch = []

    def check_empty(self) -> None:
        """After a complete step nothing of it may remain (internal invariant)."""
        tables: dict[str, dict[Key, Any]] = {
            "activations": self.acts,
            "outbox_f": self.outbox_f,
            "grads": self.grads,
            "outbox_b": self.outbox_b,
        }
        left = {k: sorted(v) for k, v in tables.items() if v}
        stages = {s: r.leftovers() for s, r in self.runners.items() if r.leftovers()}
        assert not left and not stages, f"step left state behind: {left} {stages}"


def profile_label(action: Action) -> str:
    """``F 3 mb 5``: the kind, stage and micro-batch (an overlapped pair: both parts, joined by
    `` & ``), as a profiler trace shows the action."""
    if action.parts:
        return " & ".join(profile_label(part) for part in action.parts)
    return f"{action.kind.name} {action.stage} mb {action.microbatch}"


#: what an action runs in while no profiler records (stateless, so one serves every action)
_UNLABELLED = contextlib.nullcontext()


def _labelled(action: Action) -> AbstractContextManager[object]:
    """``record_function(profile_label(action))`` while a profiler records; nothing otherwise."""
    return record_function(profile_label(action)) if profiler_enabled() else _UNLABELLED


def _show(metas: tuple[TensorMeta, ...]) -> str:
    return (
        ", ".join(f"{tuple(m.shape)} {str(m.dtype).removeprefix('torch.')}" for m in metas)
        or "nothing"
    )


def _first_layer_takes(module: torch.nn.Module) -> str | None:
    """What the stage's first layer with a declared input size takes (a linear's features, a
    convolution's channels, an embedding's vocabulary), to set beside what arrived."""
    for m in module.modules():
        for attr in ("in_features", "in_channels"):
            size = getattr(m, attr, None)
            if isinstance(size, int):
                return (
                    f"first layer with a declared input size, {type(m).__name__}, has {attr}={size}"
                )
    return None
