"""``Pipeline``: the one-line API that runs any pipetrain program on torch.distributed.

    with Pipeline(stages, schedule="zbv", num_microbatches=8, loss_fn=loss_fn) as pipe:
        opt = torch.optim.AdamW(pipe.parameters())    # this rank's stages only
        loss = pipe.step(inputs, targets)             # every rank, same arguments

Construction checks what it can before any transfer (``ValueError`` naming the legal values) and
lowers and validates the program once. A step splits the batch, runs this rank's row with the
``Executor`` and agrees on the loss with one broadcast from the last stage's rank. Modules train
in place: the caller's references see gradients and updates.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.planner.layout import Layout, PlanLike
from pipetrain.runtime import checkpoint, host_offload, losses, microbatch, resolve, side_inputs
from pipetrain.runtime import cuda_graph as step_graph
from pipetrain.runtime import microbatch_counts as counts
from pipetrain.runtime.comm import failures, teardown
from pipetrain.runtime.comm.agreement import Agreement, pipeline_prefix
from pipetrain.runtime.comm.failures import Failures, OwnedGroup, posts_failures, stops_on_failure
from pipetrain.runtime.comm.p2p import Transport
from pipetrain.runtime.dropout_rng import for_pipeline as keyed_dropout
from pipetrain.runtime.executor import Executor, StepData, cache_for
from pipetrain.runtime.extra_losses import StepTerms
from pipetrain.runtime.pair_lanes import PairLanes, close_lanes
from pipetrain.runtime.parallel import grad_norm
from pipetrain.runtime.parallel import tied as tied_weights
from pipetrain.runtime.parallel.data_parallel import DataParallel, check_wrapping
from pipetrain.runtime.parallel.mesh import MeshGroups, refuse_dtensors_without_mesh
from pipetrain.runtime.plan_checks import check_plan_fits_run
from pipetrain.runtime.precompile import Precompile
from pipetrain.runtime.resolve import DataParallelKind, Groups, Stages
from pipetrain.runtime.stage import StageRunner, arity
from pipetrain.runtime.timing import Recorder, align, gather_timeline
from pipetrain.schedule.action import Action
from pipetrain.schedule.placement import Placement
from pipetrain.schedule.program import Program
from pipetrain.schedule.timeline import Timeline

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_log = logging.getLogger(__name__)

#: ``loss_fn(last_stage_output, targets) -> scalar`` (more outputs or targets: more arguments)
LossFn = Callable[..., torch.Tensor]
#: a batch as ``step`` takes it: one tensor, or several (stage 0's positional arguments)
Tensors = torch.Tensor | Sequence[torch.Tensor]
LossReduction = Literal["mean", "sum", "token_mean"]
Side = Mapping[str, object] | None  # side inputs by name (``runtime.side_inputs``)


#: construction's phases, each named by what it makes: a failure names the first phase whose
#: attribute is not there yet (``failures.posts_failures``)
_PHASES = (
    *(("program", "checking its arguments"), ("modules", "building its stages")),
    *(("_tied_sets", "finding tied weights"), ("_data_parallel", "wrapping it for data parallel")),
    *(("_tied_grads", "preparing its stages"), ("_arities", "agreeing on the program")),
    ("_transport", "making its transfer groups"),
)


class Pipeline:
    """Pipeline-parallel training of ``stages`` under ``schedule`` (see the module docstring).

    ``stages``: a sequence of modules (ranks × stages per rank of them) or a callable
    ``stage_index -> nn.Module`` with ``num_stages=`` (each rank builds only its own).
    ``schedule``: a registry name (with ``stages_per_rank=`` where it applies) or a ``Program``.
    ``timeout``: how long any wait on a peer may take before it fails naming rank, action, peer.
    ``overlap_pairs``: an F&B pair's forward on a lane of its own (a thread; on CUDA, a stream)
    while its backward runs (DualPipe's overlap, ``runtime.pair_lanes``); off: one, then the other.
    ``defer_weight_grads``: split I/W the zero-bubble paper's way (``runtime.backward``): linear
    weight GEMMs run as ``W``, a ``B`` adding them into ``.grad``. ``False``: graph replay, any
    module. ``None`` (default): on stages the schedule splits, where plain linears hold at least
    half of the trainable parameters (``interface.choose_split``). Either way exact.
    ``loss_reduction``: what ``loss_fn`` returns for a micro-batch — ``"mean"`` over its rows,
    its ``"sum"``, or its sum over tokens whose target is not ``ignore_index`` (``"token_mean"``:
    divided by the whole batch's count); default ``loss_fn.loss_reduction`` or ``"mean"``
    (``runtime.losses``).
    ``tied``: sets of parameter names shared by several stages (``[("embed.weight",
    "head.weight")]``); their gradients are summed across stages once per step (``runtime.parallel.tied``;
    ``pipetrain.split`` detects ties in the list it cuts).
    ``mesh`` and ``data_parallel``: a ``DeviceMesh`` with dimensions ``("dp", "pp")`` (instead of
    ``group``) and ``"ddp"`` or ``"fsdp"``: each ``pp`` row of the mesh runs the pipeline, each
    ``dp`` column holds DDP or FSDP2 replicas of its stages, each replica steps on its own shard
    of the global batch, and gradients are reduced once per step (``runtime.parallel.data_parallel``).
    ``receive_lead``: post each receive at most this many compute actions before its reader
    (``schedule.lower.post_receives_late``; docs/runtime.md, "Where receives are posted"); default
    1, Megatron-Core's; 0: right before it; ``None``: where lowering puts them. ``offload``: per
    stage, the share of its activations held in host memory between forward and backward (its
    first layers, layer by layer), or an ``OffloadSpec`` (``runtime.host_offload``; docs/runtime.md).
    ``cuda_graph``: capture a training step as one CUDA graph and replay it while shapes, storage
    and modes stay (``runtime.cuda_graph``): no host time per action; ``"timed"``: with timing
    events inside the graph, so ``step(timeline=True)`` measures a replay. ``precompile``: compile
    every rank's compiled stages at once before a step of new shapes (``None``, the default:
    where every rank's stages allow it and some stage is compiled; ``False``: never). ``seed``:
    dropout masks keyed by (seed, step, global micro-batch, layer), the same on every layout and
    unsplit (``runtime.dropout_rng``; ``dropout_keys.step`` counts steps); None: torch's stream.
    """

    @posts_failures(_PHASES)
    def __init__(
        self,
        stages: Stages,
        schedule: str | Program,
        num_microbatches: int | None = None,
        loss_fn: LossFn | None = None,
        *,
        stages_per_rank: int | None = None,
        num_stages: int | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        overlap_pairs: bool = False,
        defer_weight_grads: bool | None = None,
        loss_reduction: LossReduction | None = None,
        ignore_index: int | None = None,
        tied: Sequence[Sequence[str]] = (),
        mesh: DeviceMesh | None = None,
        data_parallel: DataParallelKind | None = None,
        receive_lead: int | None = 1,
        offload: resolve.Offload = None,
        cuda_graph: bool | Literal["timed"] = False,
        precompile: bool | None = None,
        seed: int | None = None,
    ) -> None:
        resolve.require_process_group()
        groups = resolve.resolve_groups(group, mesh, data_parallel)
        self._join(groups, data_parallel, timeout)  # from here on peers hear of a failure
        if loss_fn is None:
            raise ValueError("loss_fn is required: loss_fn(last_stage_output, targets) -> scalar")
        self.loss_reduction, self._ignore_index, self._check_targets = losses.resolve(
            loss_fn, loss_reduction, ignore_index
        )
        self.device = torch.device(device) if device is not None else resolve.default_device()
        moved = resolve.offload_fractions(offload)
        step_graph.check(cuda_graph, self.device, data_parallel, mesh, moved)
        total = resolve.count_stages(stages, num_stages)
        spec = (num_microbatches, total, self.world_size, stages_per_rank, receive_lead, offload)
        self.program = resolve.resolve_program(schedule, *spec)
        self._receive_lead = receive_lead
        self._last_stage = self.placement.num_stages - 1
        self._last_rank = self.placement.rank(self._last_stage)
        mine = self.placement.stages_of_rank(self.rank)
        self.modules = resolve.local_modules(stages, mine, self.device)
        check_wrapping(self.modules, data_parallel)
        if mesh is None:
            refuse_dtensors_without_mesh(self.modules)
        self._tied_sets = self._build_tied_sets(tied, groups, stages)
        replicas = (groups.replicas, groups.replica_mesh, self.device)
        self._data_parallel = DataParallel.build(
            data_parallel, self.modules, *replicas, self.loss_reduction, self._tied_sets
        )
        self._runners = self._build_runners(loss_fn, defer_weight_grads, offload, bool(cuda_graph))
        where = (self.device, self.num_microbatches, groups.replicas, groups.mesh, bool(cuda_graph))
        self.dropout_keys = keyed_dropout(seed, self.modules, *where)
        wide = self._data_parallel is not None or mesh is not None
        self._precompile = Precompile.build(precompile, self._agreement, self._runners, wide)
        kept = (self._agreement, self._extra_terms, self.dropout_keys)
        self._counts = counts.for_pipeline(self.program, spec, schedule, cuda_graph, moved, *kept)
        dp = self._data_parallel  # tied gradients averaged over the replicas where they are
        average_over = dp.size if dp is not None and dp.reduction == "mean" else 1
        self._tied_grads = tied_weights.TiedGrads(self._tied_sets, self._runners, average_over)
        self._arities: list[tuple[int, float]] = self._agreement.construction(
            self.program, {s: arity(m) for s, m in self.modules.items()}
        )
        self._transport = self._build_transport(timeout)
        self._lanes = PairLanes.build(overlap_pairs, self.device, self._runners, timeout, mesh)
        self._side: tuple[dict[str, object], ...] = ()
        self._side_keywords_all: list[frozenset[str] | None] | None = None
        self._failure: str | None = None
        self.last_timeline: Timeline | None = None
        #: the last step's extra loss terms by name, every rank's (``runtime.extra_losses``)
        self.extra_losses: dict[str, float] = {}
        self.closed = False
        held = self._runners[self._last_stage].losses if self.rank == self._last_rank else None
        self.graph = step_graph.build(
            cuda_graph, self.device, self.modules.values(), held, self.rank
        )

    def _join(
        self, groups: Groups, data_parallel: DataParallelKind | None, timeout: timedelta
    ) -> None:
        """This rank's place in its group, the groups its sums span, how its ranks agree."""
        self.group = groups.pipeline
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        #: this pipeline's data-parallel replicas: ``"token_mean"``'s token count is summed over it
        self._data_parallel_group = groups.replicas
        #: the mesh's groups and this rank's coordinates on it (``runtime.parallel.mesh``)
        self._mesh: MeshGroups | None = groups.mesh
        prefix = pipeline_prefix(self.group, self.rank)
        self._failures = Failures(self.group, self.rank, self.world_size, prefix)
        self._agreement = Agreement(self.group, self.rank, self.world_size, timeout, self._failures)

    def _build_tied_sets(
        self, tied: Sequence[Sequence[str]], groups: Groups, stages: Stages
    ) -> list[tied_weights.TiedSet]:
        """The pipeline's tied sets (collective), found before data parallel wraps the stages:
        ``runtime.parallel.tied`` reduces tied parameters itself. A ``Parameter`` that several
        stages of a stage list share is tied as if declared (every rank holds the list)."""
        found = tied_weights.shared_in_stage_list(stages) if isinstance(stages, Sequence) else []
        gather = functools.partial(self._agreement.gather, "tied weights")
        ranks = (self.group, self.rank, self.world_size, groups.replicas)
        return tied_weights.build([*tied, *found], self.modules, *ranks, gather=gather, found=found)

    def _build_runners(
        self, loss_fn: LossFn, defer: bool | None, offload: resolve.Offload, captured: bool
    ) -> dict[int, StageRunner]:
        """A runner per local stage, told its last weight piece (hooks fire); ``_extra_terms``."""
        last, row = self._last_stage, self.program.actions[self.rank]
        split = resolve.split_backward_stages(row)
        runners = {
            s: StageRunner(s, m, s == last, loss_fn, defer, None, captured, s in split)
            for s, m in self.modules.items()
        }
        host_offload.attach(runners, resolve.offload_fractions(offload), row, self.device)
        for stage, mb in resolve.last_weight_pieces(row).items():
            runners[stage].last_weight_microbatch = mb
        for runner in runners.values():
            runner.syncs_once = self._data_parallel is not None
        weighing = (self.num_microbatches, self._data_parallel, self._agreement, self._last_rank)
        self._extra_terms = StepTerms(runners.values(), *weighing)
        return runners

    def _build_transport(self, timeout: timedelta) -> Transport:
        """The transfers' groups and transport: on gloo a group of its own, let go of (with the
        stores) on failure, close or exit; on NCCL a second group (``resolve.reverse_group``)."""
        teardown.leave_together_at_exit(timeout)  # every group destroyed at exit, together
        self._owned = OwnedGroup.transfer_group(self.group, timeout)
        self._reverse_group = resolve.reverse_group(self.group)
        group, reverse = self._owned.group or self.group, self._reverse_group
        transport = Transport(
            self.rank, group, self.device, timeout, reverse_group=reverse, failures=self._failures
        )
        holders = (transport, self._failures, self._agreement)
        self._release_at_exit = weakref.finalize(self, self._owned.release, *holders)
        return transport

    @property
    def placement(self) -> Placement:
        """Which rank runs each stage (the program's)."""
        return self.program.placement

    @property
    def num_microbatches(self) -> int:
        return self.program.num_microbatches

    @property
    def data_parallel(self) -> DataParallel | None:
        """This rank's stages' data-parallel replicas (``mesh=``; checkpoints ask), else None."""
        return self._data_parallel

    @property
    def mesh_groups(self) -> MeshGroups | None:
        """The mesh's groups and this rank's coordinates but ``pp`` (``mesh=``), else None."""
        return self._mesh

    #: the fields a plan must give (``pipetrain plan --json`` prints them, with ``predicted``)
    PLAN_FIELDS = Layout.FIELDS

    @classmethod
    def from_plan(
        cls,
        layers: Sequence[nn.Module] | Mapping[str, nn.Module] | Callable[[int], nn.Module],
        plan: PlanLike,
        loss_fn: LossFn | None = None,
        **kwargs: Any,
    ) -> Pipeline:
        """Run a plan: ``layers`` (a list of layers, a mapping name → layer, or a factory
        ``index -> layer``) cut by the plan's ``stage_layers`` (``pipetrain.split``), under its
        schedule (or the program it carries), stages per rank and micro-batches. ``plan``: a
        ``Layout``, anything with one (a ``pipetrain.planner.Plan``) or ``pipetrain plan
        --json``'s dict; ``kwargs``: other ``Pipeline`` options (``device``, ``mesh``...).
        Refused: a plan for another pipeline size than the group's (the mesh's ``pp``), whose cut
        and schedule were chosen for that size (``runtime.resolve``); an N-D plan on a mesh of
        other tp or dp sizes (``runtime.plan_checks``)."""
        layout = resolve.plan_layout(plan)  # checked: a ValueError names a bad field
        check_plan_fits_run(layout, kwargs)
        stages = resolve.plan_stages(layers, layout, kwargs)
        args = (stages, layout.pipeline_schedule, layout.microbatches, loss_fn)
        kwargs |= {"stages_per_rank": layout.stages_per_rank, "num_stages": layout.num_stages}
        return cls(*args, **kwargs, offload=layout.offload_spec)

    def close(self) -> None:
        """Finish what is in flight and let go of what this pipeline made (posted transfers, its
        process groups, each stage's held state; the modules stay, trained in place). Idempotent;
        a closed pipeline refuses to step. ``with Pipeline(...) as pipe:`` closes on the way out."""
        if self.closed:
            return
        self.closed = True
        try:
            self._transport.drain()
            if self.graph is not None:
                self.graph.release(synchronize=True)
        finally:
            if self._reverse_group is not None and dist.is_initialized():
                dist.destroy_process_group(self._reverse_group)
            self._reverse_group = None
            self._let_go()
            self._counts.clear()

    def _stop_after(self, error: BaseException) -> None:
        """A step failed here: tell the peers (notice, then close this pipeline's group, so their
        waits end now) and refuse further steps."""
        if self.closed:
            return
        origin = getattr(error, "origin", self.rank)
        self._failures.post(origin, failures.notice_of(error), failures.refusal(error))
        self.closed = True
        self._failure = f"{type(error).__name__}: {error}"
        self._transport.abandon()
        self._let_go()

    def _let_go(self) -> None:
        """Release each stage's held state and this pipeline's groups (the transport's were the
        last references: destroying the owned group closes its connections)."""
        for runner in self._runners.values():
            runner.release()
        close_lanes(self._lanes)
        if self.graph is not None:
            self.graph.release()
        self._release_at_exit()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stage parameters, each once (for the optimizer)."""
        yield from {id(p): p for m in self.modules.values() for p in m.parameters()}.values()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by global name (``runtime.checkpoint``): the union
        over the ranks is the unsplit model's state dict."""
        return checkpoint.model_state(self.modules[s] for s in sorted(self.modules))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's tensors from ``state`` (a whole model's, or any ranks' union);
        a missing name is a ``KeyError`` naming it, a shape mismatch a ``ValueError``."""
        checkpoint.load_model_state([self.modules[s] for s in sorted(self.modules)], state)

    @stops_on_failure
    def step(
        self,
        inputs: Tensors,
        targets: Tensors | None,
        timeline: bool = False,
        *,
        side: Mapping[str, object] | None = None,
        num_microbatches: int | None = None,
    ) -> torch.Tensor:
        """One training step; returns the batch's loss (per ``loss_reduction``) on every rank.

        ``inputs``: stage 0's positional arguments, each split along dim 0 into micro-batches;
        ``targets`` likewise, given to ``loss_fn``. ``timeline``: measure the step; every rank's
        spans are gathered into ``last_timeline``. Gradients accumulate into ``.grad`` (zero them
        as with any torch training loop). ``side``: side inputs by name (an attention mask...) for
        the stages that take them, split per micro-batch where batched (``runtime.side_inputs``).
        ``num_microbatches``: this step's (None: the pipeline's; ``runtime.microbatch_counts``).
        """
        step_graph.check_step(self.graph, timeline)
        mbs = self._split(inputs, targets, side, num_microbatches)
        if self._data_parallel is not None:
            self._data_parallel.check_batch(mbs.batch_size)
        weights = losses.weights(
            self.loss_reduction, mbs.weights, targets, self._ignore_index, self._data_parallel_group
        )
        mbs = dataclasses.replace(mbs, weights=weights)
        rows = self.program.actions[self.rank]
        self._tied_grads.begin_step()
        if self.graph is not None:
            run = functools.partial(self._execute, rows, mode="train", timeline=timeline)
            shapes = (mbs.inputs, mbs.targets, mbs.batch_size)
            announce = functools.partial(self._agreement.step, "train", *shapes)
            line_up = functools.partial(align, self._transport.group, True) if timeline else None
            how = self.graph.step(mbs, self._side, announce, run, self._agreement, line_up)
            if timeline and how != "eager":  # a replay: the events recorded at capture
                self.last_timeline = self._gather(self.graph.recorder)  # type: ignore[arg-type]
        else:
            self._execute(rows, mbs, self._side, "train", timeline)
        self._tied_grads.end_step(self._transport, self.rank)
        self.dropout_keys.step += 1
        loss, self.extra_losses = self._extra_terms.agree(mbs.weights, self._transport)
        if self._data_parallel is not None:
            loss = self._data_parallel.global_loss(loss)
        return loss

    @staticmethod
    def loss_is_finite(loss: torch.Tensor) -> bool:
        """Whether ``step``'s loss is finite: the same on every rank (all return one broadcast)."""
        return bool(torch.isfinite(loss).all())

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every rank's gradients by the whole model's norm, each element counted once, like
        ``torch.nn.utils.clip_grad_norm_`` unsplit; returns it on every rank (collective)."""
        where = (self._tied_sets, self.rank, self._mesh, self.group, self.device)
        return grad_norm.clip_pipeline(self.parameters(), *where, max_norm, norm_type)

    @stops_on_failure
    def eval_step(
        self, inputs: Tensors, *, side: Side = None, num_microbatches: int | None = None
    ) -> microbatch.Batch | None:
        """Forward only (as ``step``); the last stage's outputs (merged) on its rank, else None."""
        mbs = self._split(inputs, None, side, num_microbatches)
        rows = self._counts.active.forward_only(self.rank, self._receive_lead)
        with torch.no_grad():
            results = self._execute(rows, mbs, self._side, "eval", False)
        if self.rank != self._last_rank:
            return None
        outs = [results[j] for j in range(self.num_microbatches)]
        return microbatch.merge(outs, single=len(outs[0]) == 1)

    def _split(
        self, inputs: Tensors, targets: Tensors | None, side: Side, count: int | None
    ) -> microbatch.MicroBatches:
        """The batch on this device in ``count``'s micro-batches (side inputs: ``_side``)."""
        resolve.require_process_group()
        if self.closed:
            why = f" after a failure ({self._failure})" if self._failure else ""
            raise RuntimeError(f"this Pipeline was closed{why}; build a new one to keep training")
        self.program = self._counts.select(count).program
        self._check_targets(targets)
        xs, ys = microbatch.to_device(inputs, targets, self.device)
        mbs = microbatch.split(xs, ys, self.num_microbatches)
        self._side = ()
        if side:
            side_inputs.check(side, self._side_keywords())
            self._side = side_inputs.split(side, mbs.batch_size, self.num_microbatches, self.device)
        return mbs

    def _side_keywords(self) -> list[frozenset[str] | None]:
        """Every stage's side-input names (gathered from all ranks on first use)."""
        if self._side_keywords_all is None:
            mine, ranks = [r.side_keywords for r in self._runners.values()], self.world_size
            self._side_keywords_all = side_inputs.everyones_keywords(mine, self.group, ranks)
        return self._side_keywords_all

    def _execute(
        self,
        rows: tuple[Action, ...],
        mbs: microbatch.MicroBatches,
        side: tuple[dict[str, object], ...],
        mode: Literal["train", "eval"],
        timeline: bool,
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        """Run ``rows`` on ``mbs`` and ``side``: this rank's share of the step (or of a
        forward-only pass); returns the last stage's outputs by micro-batch (eval on its rank)."""
        signature = (mbs.batch_size, *((tuple(x.shape), x.dtype) for x in mbs.inputs[0]))
        cache, discover = cache_for(self._counts.active.caches, mode, signature)
        # a replayed step is announced before its replay (``StepGraph.step``)
        self._agreement.step(mode, mbs.inputs, mbs.targets, mbs.batch_size)
        if self._precompile is not None and mode == "train":
            self._precompile.before_step(self.placement, mbs.inputs[0], side[0] if side else None)
        if self._data_parallel is not None:
            self._data_parallel.begin(train=mode == "train")
        for runner in self._runners.values():
            runner.begin_step()
        captured = self.graph.capturing_recorder() if self.graph is not None else None
        recorder = captured or Recorder(self.rank, self.device, timeline)
        recorder.begin(self._transport.group)  # the pipeline's own group: its timeout holds
        after = self._sync_after if self._data_parallel is not None and mode == "train" else None
        runners, transport = self._runners, self._transport
        where = (self.placement, runners, transport, self._arities, self._lanes, after)
        executor = Executor(self.rank, *where, keys=self.dropout_keys)
        data = StepData(mbs.inputs, mbs.targets, mbs.weights, side)
        executor.run(rows, data, cache, recorder, train=mode == "train", discover=discover)
        if self._data_parallel is not None:
            (self._data_parallel.finish_all if mode == "train" else self._data_parallel.end_eval)()
        executor.check_empty()
        if timeline and captured is None:
            self.last_timeline = self._gather(recorder)
        return executor.results

    def _gather(self, recorder: Recorder) -> Timeline:
        """Every rank's spans as ``last_timeline`` (the group is looked up here, not held: the
        transport's references must be the last, so that a failure closes it)."""
        group, stages = self._transport.group, self.placement.num_stages
        return gather_timeline(group, self.world_size, stages, recorder, self.program.name)

    def _sync_after(self, action: Action) -> None:
        """After a stage's last compute action: its data-parallel sync, overlapping the rest."""
        assert self._data_parallel is not None  # only installed with data parallel
        for stage in self._counts.active.last_uses.get(action, ()):
            self._data_parallel.finish(stage)
