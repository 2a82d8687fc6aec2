"""``Pipeline``: the one-line API that runs any pipetrain program on torch.distributed.

    with Pipeline(stages, schedule="zbv", num_microbatches=8, loss_fn=loss_fn) as pipe:
        opt = torch.optim.AdamW(pipe.parameters())    # this rank's stages only
        loss = pipe.step(inputs, targets)             # every rank, same arguments

Construction checks everything it can before any transfer (stage count, world size, process
group, module types) and raises ``ValueError`` naming the legal values; it then lowers and
validates the program once. A step splits the batch, runs this rank's row with the ``Executor``,
and agrees on the loss with one broadcast from the rank holding the last stage. Modules are
trained in place (``module.to(device)``), so the caller's references see gradients and updates.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.planner.layout import Layout
from pipetrain.runtime import checkpoint, losses, microbatch, resolve, side_inputs
from pipetrain.runtime.comm.agreement import Agreement, pipeline_prefix
from pipetrain.runtime.comm.failures import Failures, OwnedGroup, posts_failures, stops_on_failure
from pipetrain.runtime.comm.p2p import DTYPE_CODE, DTYPES, Transport
from pipetrain.runtime.executor import Executor, MetaCache, StepData
from pipetrain.runtime.parallel import grad_norm
from pipetrain.runtime.parallel import tied as tied_weights
from pipetrain.runtime.parallel.data_parallel import DataParallel, check_wrapping
from pipetrain.runtime.parallel.mesh import (
    MeshGroups,
    norm_share,
    refuse_dtensors_without_mesh,
    resolve_mesh,
)
from pipetrain.runtime.resolve import Stages
from pipetrain.runtime.stage import StageRunner, arity
from pipetrain.runtime.timing import Recorder, gather_timeline
from pipetrain.schedule.action import Action
from pipetrain.schedule.program import Program
from pipetrain.schedule.timeline import Timeline


class Pipeline:
    """Pipeline-parallel training of ``stages`` under ``schedule`` (see the module docstring).

    ``stages``: a sequence of modules (ranks × stages per rank of them) or a callable
    ``stage_index -> nn.Module`` with ``num_stages=`` (each rank builds only its own).
    ``schedule``: a registry name (with ``stages_per_rank=`` where it applies) or a ``Program``.
    ``timeout``: how long any wait on a peer may take before it fails naming rank, action, peer.
    ``overlap_pairs``: on CUDA, run an overlapped F&B pair's forward on a side stream while its
    backward runs (DualPipe's overlap; off: one after the other). Ignored on CPU.
    ``defer_weight_grads``: split I/W the zero-bubble paper's way — while a stage runs, its plain
    ``nn.Linear`` layers' weight GEMMs are left out of ``I`` and run as ``W``, and a ``B`` adds
    them straight into ``.grad`` (``runtime.backward.deferred_wgrad``; the modules themselves are never
    changed). ``False``: ``graph_replay``'s graph replay, which splits any module.
    ``None`` (default): per stage, on where plain linears hold at least half of its trainable
    parameters. Either way exact.
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
    ``receive_lead``: post each receive at most this many compute actions before the one that
    reads it (``schedule.lower.post_receives_late``). Default 1, Megatron-Core's overlapped P2P:
    the transfer runs under the compute just before its reader. On NCCL a posted receive is a
    kernel resident on the GPU until its data comes, slowing the compute beside it; receives
    posted where lowering puts them, as soon as the value can have arrived (``None``), were up
    to 2–4% slower on interleaved 1F1B (docs/incumbents.md). 0 posts each right before its
    reader. A program you pass already lowered is moved too; ``None`` runs it as given. The
    moved program is checked against this runtime's transport (``validate(..., "posted")``).
    """

    @posts_failures
    def __init__(
        self,
        stages: Stages,
        schedule: str | Program,
        num_microbatches: int | None = None,
        loss_fn: Callable | None = None,
        *,
        stages_per_rank: int | None = None,
        num_stages: int | None = None,
        group=None,
        device: torch.device | str | None = None,
        timeout: timedelta = timedelta(minutes=10),
        overlap_pairs: bool = False,
        defer_weight_grads: bool | None = None,
        loss_reduction: str | None = None,
        ignore_index: int | None = None,
        tied: Sequence[Sequence[str]] = (),
        mesh=None,
        data_parallel: str | None = None,
        receive_lead: int | None = 1,
    ) -> None:
        resolve.require_process_group()
        if loss_fn is None:
            raise ValueError("loss_fn is required: loss_fn(last_stage_output, targets) -> scalar")
        self.loss_reduction, self.ignore_index = losses.resolve(
            loss_fn, loss_reduction, ignore_index
        )
        #: data-parallel replicas of this pipeline (set by a data-parallel wrapper): the token
        #: count of ``"token_mean"`` is summed over it
        self.data_parallel_group: Any = None
        #: the mesh's groups and this rank's coordinates (``runtime.parallel.mesh``), or None
        self.mesh_groups: MeshGroups | None = None
        dp_group = dp_mesh = None
        if mesh is not None:
            if group is not None:
                raise ValueError("pass either group= or mesh= (whose 'pp' dimension is the group)")
            self.mesh_groups = resolve_mesh(mesh, data_parallel)
            group = self.mesh_groups.pipeline
            dp_group, dp_mesh = self.mesh_groups.data, self.mesh_groups.data_mesh
            self.data_parallel_group = dp_group
        elif data_parallel is not None:
            raise ValueError(
                f"data_parallel={data_parallel!r} needs mesh=: a DeviceMesh with a 'pp' and a "
                "'dp' (or 'dp_replicate' and 'dp_shard') dimension"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.failures = Failures(
            group, self.rank, self.world_size, pipeline_prefix(group, self.rank)
        )
        self.agreement = Agreement(group, self.rank, self.world_size, timeout, self.failures)
        self.loss_fn = loss_fn
        self.timeout = timeout
        self.device = torch.device(device) if device is not None else resolve.default_device()
        total = resolve.count_stages(stages, num_stages)
        self.program = resolve.resolve_program(
            schedule, num_microbatches, total, self.world_size, stages_per_rank, receive_lead
        )
        self.num_microbatches = self.program.num_microbatches
        self.receive_lead = receive_lead
        self.placement = self.program.placement
        self.last_stage = self.placement.num_stages - 1
        self.last_rank = self.placement.rank(self.last_stage)
        self.modules = resolve.local_modules(
            stages, self.placement.stages_of_rank(self.rank), self.device
        )
        check_wrapping(self.modules, data_parallel)
        if mesh is None:
            refuse_dtensors_without_mesh(self.modules)
        # before data parallel wraps the stages: tied parameters are reduced by runtime.parallel.tied
        self.tied_sets = tied_weights.build(
            tied,
            self.modules,
            group,
            self.rank,
            self.world_size,
            dp_group,
            gather=lambda record: self.agreement.gather("tied weights", record),
        )
        if (
            data_parallel == "fsdp"
            and self.tied_sets
            and dist.get_backend(cast(Any, dp_group)) == "nccl"
        ):
            # Exact on gloo (tests), but a pp=2 x dp=2 zbv run on 4 GPUs hung before its first
            # step (docs/training-gpu.md): refused until that is understood, never a hang.
            raise ValueError(
                "tied weights with data_parallel='fsdp' on NCCL are not supported yet (a 4-GPU "
                "run hung); use data_parallel='ddp' or untie the weights"
            )
        self.data_parallel = (
            DataParallel(
                data_parallel,
                self.modules,
                dp_group,
                dp_mesh,
                self.device,
                # a sum, or a mean over the global token count, adds the replicas' gradients
                reduction="mean" if self.loss_reduction == "mean" else "sum",
                tied=frozenset(id(p) for t in self.tied_sets for p in t.local),
            )
            if data_parallel is not None
            else None
        )
        self.runners = {
            s: StageRunner(s, m, s == self.last_stage, loss_fn, defer_weight_grads)
            for s, m in self.modules.items()
        }
        for stage, mb in resolve.last_weight_pieces(self.program.actions[self.rank]).items():
            self.runners[stage].last_weight_microbatch = mb
        self._last_uses = resolve.last_uses(self.program.actions[self.rank])
        self.arities = self.agreement.construction(
            self.program, {s: arity(m) for s, m in self.modules.items()}
        )
        # On gloo, transfers and the loss go through a group of this pipeline's own, which it can
        # close on failure (``failures``) and destroys on close or at interpreter exit.
        self._owned = OwnedGroup.transfer_group(group, timeout)
        self._release_at_exit = weakref.finalize(self, self._owned.release)
        self._reverse_group = resolve.reverse_group(group)
        dp = self.data_parallel
        self.tied_grads = tied_weights.TiedGrads(
            self.tied_sets,
            self.runners,
            dp.size if dp is not None and dp.reduction == "mean" else 1,
        )
        self.transport = Transport(
            self.rank,
            self._owned.group or group,
            self.device,
            timeout,
            reverse_group=self._reverse_group,
            failures=self.failures,
        )
        self.side_stream = (
            torch.cuda.Stream(self.device) if overlap_pairs and self.device.type == "cuda" else None
        )
        self._caches: dict[str, MetaCache] = {}
        self._eval_program: Program | None = None
        self._side: tuple[dict, ...] = ()
        self._side_keywords_all: list | None = None
        self.last_timeline: Timeline | None = None
        self.closed = False

    #: the fields a plan must give (``pipetrain plan --json`` prints them, with ``predicted``)
    PLAN_FIELDS = Layout.FIELDS

    @classmethod
    def from_plan(cls, layers, plan, loss_fn: Callable | None = None, **kwargs) -> Pipeline:
        """Run a plan: ``layers`` (the model as an ordered list of layers, a mapping name →
        layer, or a factory ``index -> layer``) cut by the plan's ``stage_layers`` with
        ``pipetrain.split``, under the plan's schedule, stages per rank and micro-batches.

        ``plan``: a ``pipetrain.planner.Plan`` or the dict ``pipetrain plan --json`` prints.
        ``kwargs``: any other ``Pipeline`` option (``device``, ``mesh``, ``tied``...). A plan made
        for another number of pipeline ranks than this process group's (the mesh's ``pp``
        dimension with ``mesh=``) is refused: its cut and its schedule were chosen for that
        size (``runtime.resolve``)."""
        layout = cls.plan_layout(plan)
        stages = resolve.plan_stages(layers, layout, kwargs)
        return cls(
            stages,
            layout.schedule,
            layout.microbatches,
            loss_fn,
            stages_per_rank=layout.stages_per_rank,
            **kwargs,
        )

    @classmethod
    def plan_layout(cls, plan: object) -> Layout:
        """The ``Layout`` of a ``Plan``, a ``Layout`` or a plan dict, checked (a ``ValueError``
        names the first missing or bad field)."""
        return resolve.plan_layout(plan)

    def close(self) -> None:
        """Finish what is in flight and let go of everything this pipeline made: transfers still
        posted, the second process group it created (NCCL), each stage's held state. The stage
        modules stay as they were given (trained in place, never altered). Idempotent; a closed
        pipeline refuses to step. ``with Pipeline(...) as pipe:`` closes on the way out."""
        if self.closed:
            return
        self.closed = True
        try:
            self.transport.drain()
        finally:
            for runner in self.runners.values():
                runner.release()
            if self._reverse_group is not None and dist.is_initialized():
                dist.destroy_process_group(self._reverse_group)
            self._reverse_group = None
            self.transport.forget_groups()
            self._release_at_exit()
            self.side_stream = None
            self._caches.clear()

    def _stop_after(self, error: BaseException) -> None:
        """A step failed here: tell the peers (notice, then close this pipeline's group, so their
        waits end now) and refuse further steps."""
        if self.closed:
            return
        origin = getattr(error, "origin", self.rank)
        self.failures.post(origin, f"{type(error).__name__}: {error}")
        self.closed = True
        self._failure = f"{type(error).__name__}: {error}"
        for runner in self.runners.values():
            runner.release()
        self.transport.abandon()
        self.transport.forget_groups()  # the last reference: destroying the group closes it
        self._release_at_exit()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stage parameters, each once (for the optimizer)."""
        seen: set[int] = set()
        for module in self.modules.values():
            for p in module.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by global name (``runtime.checkpoint``): the union
        over the ranks is the unsplit model's state dict."""
        return checkpoint.model_state(self.modules[s] for s in sorted(self.modules))

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy this rank's tensors from ``state`` (a whole model's, or any ranks' union);
        a missing name is a ``KeyError`` naming it, a shape mismatch a ``ValueError``."""
        checkpoint.load_model_state([self.modules[s] for s in sorted(self.modules)], state)

    @stops_on_failure
    def step(self, inputs, targets, timeline: bool = False, *, side=None) -> torch.Tensor:
        """One training step; returns the batch's loss (per ``loss_reduction``) on every rank.

        Gradients accumulate into ``.grad`` (zero them as with any torch training loop).
        ``side``: side inputs by name (an attention mask...), given to the stages whose forward
        takes them, split per micro-batch where batched (``runtime.side_inputs``).
        """
        mbs = self._split(inputs, targets, side)
        if self.data_parallel is not None:
            self.data_parallel.check_batch(mbs.batch_size)
        weights = losses.weights(
            self.loss_reduction,
            mbs.weights,
            targets,
            self.ignore_index,
            self.data_parallel_group,
        )
        mbs = dataclasses.replace(mbs, weights=weights)
        rows = self.program.actions[self.rank]
        self.tied_grads.begin_step()
        self._execute(rows, mbs, "train", timeline, self.program.name)
        self.tied_grads.end_step(self.transport, self.rank)
        loss = self._agree_on_loss(mbs.weights)
        if self.data_parallel is not None:
            loss = self.data_parallel.global_loss(loss)
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every rank's gradients by the norm of the whole pipeline's (a tied parameter
        counted once), like ``torch.nn.utils.clip_grad_norm_`` on the unsplit model; returns
        that norm on every rank (collective: every rank calls it)."""
        counted, scaled = self._grads_for_norm()
        others = self.mesh_groups.norm_groups() if self.mesh_groups is not None else []
        total = grad_norm.global_norm(counted, float(norm_type), [self.group, *others], self.device)
        grad_norm.clip_(scaled, total, max_norm)
        return total

    def _grads_for_norm(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(what this rank counts in the norm, the gradients it scales): a tied parameter is
        counted by its first owner only, and across the mesh's other dimensions each element by
        one rank (``mesh.norm_share``: a shard where sharded, coordinate 0 where replicated)."""
        skip = set()
        for t in self.tied_sets:
            for i, p in enumerate(t.local):
                if i > 0 or self.rank != t.first_owner:
                    skip.add(id(p))
        coordinates = self.mesh_groups.coordinates if self.mesh_groups is not None else {}
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        counted = []
        for p in self.parameters():
            if p.grad is not None and id(p) not in skip:
                share = norm_share(p.grad, coordinates)
                if share is not None:
                    counted.append(share)
        return counted, grads

    @stops_on_failure
    def eval_step(self, inputs, *, side=None):
        """Forward only; the last stage's outputs (merged) on the rank that holds it, else None."""
        if self._eval_program is None:
            self._eval_program = resolve.forward_only(self.program, self.receive_lead)
        mbs = self._split(inputs, None, side)
        rows = self._eval_program.actions[self.rank]
        with torch.no_grad():
            results = self._execute(rows, mbs, "eval", False, self.program.name)
        if self.rank != self.last_rank:
            return None
        outs = [results[j] for j in range(self.num_microbatches)]
        return microbatch.merge(outs, single=len(outs[0]) == 1)

    def _split(self, inputs, targets, side=None) -> microbatch.MicroBatches:
        resolve.require_process_group()
        if self.closed:
            why = f" after a failure ({self._failure})" if getattr(self, "_failure", None) else ""
            raise RuntimeError(f"this Pipeline was closed{why}; build a new one to keep training")
        xs = tuple(x.to(self.device) for x in microbatch.as_tuple(inputs, "inputs"))
        ys = targets
        if isinstance(targets, torch.Tensor):
            ys = targets.to(self.device)
        elif isinstance(targets, (tuple, list)):
            ys = tuple(t.to(self.device) for t in microbatch.as_tuple(targets, "targets"))
        mbs = microbatch.split(xs, ys, self.num_microbatches)
        self._side = ()
        if side:
            side_inputs.check(side, self._side_keywords())
            self._side = side_inputs.split(side, mbs.batch_size, self.num_microbatches, self.device)
        return mbs

    def _side_keywords(self) -> list:
        """Every stage's side-input names (gathered from all ranks on first use)."""
        if self._side_keywords_all is None:
            mine = [r.side_keywords for r in self.runners.values()]
            everyone: list = [None] * self.world_size
            if self.world_size > 1:
                dist.all_gather_object(everyone, mine, group=self.group)
            else:
                everyone = [mine]
            self._side_keywords_all = [k for part in everyone for k in part]
        return self._side_keywords_all

    def _execute(self, rows, mbs, mode: str, timeline: bool, name: str):
        signature = (mbs.batch_size, *((tuple(x.shape), x.dtype) for x in mbs.inputs[0]))
        cache = self._caches.get(mode)
        discover = cache is None or cache.signature != signature
        if cache is None or discover:
            cache = self._caches[mode] = MetaCache(signature=signature)
        self.agreement.step(mode, mbs.inputs, mbs.targets, mbs.batch_size)
        if self.data_parallel is not None:
            self.data_parallel.begin(train=mode == "train")
        for runner in self.runners.values():
            runner.begin_step()
        recorder = Recorder(self.rank, self.device, timeline)
        recorder.begin(self.transport.group)  # the pipeline's own group: its timeout holds
        after = self._sync_after if self.data_parallel is not None and mode == "train" else None
        executor = Executor(
            self.rank,
            self.placement,
            self.runners,
            self.transport,
            self.arities,
            self.side_stream,
            after,
        )
        data = StepData(mbs.inputs, mbs.targets, mbs.weights, self._side)
        executor.run(rows, data, cache, recorder, train=mode == "train", discover=discover)
        if self.data_parallel is not None:
            if mode == "train":
                self.data_parallel.finish_all()
            else:
                self.data_parallel.end_eval()
        executor.check_empty()
        if timeline:
            self.last_timeline = gather_timeline(
                recorder,
                self.transport.group,
                self.world_size,
                self.placement.num_stages,
                name,
            )
        return executor.results

    def _sync_after(self, action: Action) -> None:
        """After a stage's last compute action of the step: its data-parallel gradient sync, so
        the reduction overlaps the rest of the row (on CUDA)."""
        assert self.data_parallel is not None  # only installed with data parallel
        for stage in self._last_uses.get(action, ()):
            self.data_parallel.finish(stage)

    def _agree_on_loss(self, weights: tuple[float, ...]) -> torch.Tensor:
        """Σ_j w_j · loss_j from the last stage, broadcast so every rank returns the same value."""
        value = torch.zeros(2, dtype=torch.float64, device=self.device)
        if self.rank == self.last_rank:
            losses = self.runners[self.last_stage].losses
            dtype = losses[0].dtype
            value[0] = sum(w * losses.pop(j).double() for j, w in enumerate(weights))
            value[1] = DTYPE_CODE.get(dtype, DTYPE_CODE[torch.float64])
        if self.world_size > 1:
            group = self.transport.group
            src = self.last_rank if group is None else dist.get_global_rank(group, self.last_rank)
            work = dist.broadcast(value, src, group=group, async_op=True)
            self.transport.wait_work(work, "the loss broadcast", self.last_rank)
        return value[0].to(DTYPES[int(value[1].item())])
