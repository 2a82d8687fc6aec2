"""Data parallel on top of the pipeline: DDP or FSDP2 replicas of every stage, synced once a step.

A ``DeviceMesh`` lays the ranks out (``runtime.parallel.mesh``): each ``pp`` line runs the
pipeline, each ``dp`` line (or HSDP's ``dp_replicate`` × ``dp_shard``) holds replicas of the same
stages, each fed its own shard of the global batch. What makes this exact is *when* the replicas talk. A stage runs one forward and
one or two backward pieces (``B``, or ``I`` then ``W``) per micro-batch, and its weight gradients
are only whole after its last piece of the step; a wrapper that reduces on every backward would
reduce partial sums (wrong gradients, not rounding: docs/training-gpu.md). So here, as in
torch.distributed.pipelining's stage (``backward_maybe_with_nosync``, ``perform_reduce_grad``):

* **DDP** (``DistributedDataParallel`` on the ``dp`` group): forwards call the wrapped module
  directly, so the reducer expects no gradients during the step. After the stage's last
  backward piece, ``finish`` arms the reducer (``prepare_for_backward``) and runs one backward
  of zeros into every trainable parameter: ``AccumulateGrad`` adds nothing, fires the reducer's
  hooks once per parameter, and DDP all-reduces its buckets (its own buckets, comm hooks and
  averaging) exactly once.
* **FSDP2** (``fully_shard`` on the ``dp`` mesh): ``begin`` all-gathers every FSDP module of the
  stage once (``unshard``) and turns gradient sync and resharding off
  (``set_requires_gradient_sync(False)``, ``set_reshard_after_backward(False)``,
  ``set_is_last_backward(False)``, and no reshard after forward), so every micro-batch's pieces
  add into the unsharded parameters' gradients. ``finish`` turns them on and runs each parameter
  group's ``post_backward`` (reduce-scatter, reshard) and the root's final callback — what a
  plain ``loss.backward()`` ends with. Memory is ZeRO-2's during a step (parameters gathered
  from the first forward to the last backward piece), ZeRO-3's between steps.

With ``reduction="mean"`` (the default) both wrappers average over the ``dp`` group, so each
replica's loss must be the mean over an equal share of the global batch: ``check_batch`` refuses
unequal local batch sizes before any compute, and ``global_loss`` returns the mean of the
replicas' losses, which is then the loss of the global batch. With ``reduction="sum"`` (a loss
already normalised over the global batch, or a summed loss) gradients and losses are summed
instead: DDP through a comm hook that all-reduces without dividing, FSDP2 with a gradient divide
factor of 1. Every trainable parameter must get a gradient in every step (a replica
missing one would leave the others' reduction waiting): one that gets none is an error naming
it (freeze it with ``requires_grad_(False)``).

Expert-parallel parameters (``runtime.parallel.expert_parallel``: ``DTensor`` shards on the
``("edp", "ep")`` sub-mesh) are not DDP's either: DDP ignores them, ``__init__`` makes every
``edp`` replica of a shard start equal (a broadcast, as DDP does for the rest), and ``finish``
sums each shard's gradient over ``edp`` — the ``ep`` peers' tokens already reached it through
the all-to-all's backward — and divides by the whole ``edp × ep`` size where DDP averages, so
an expert's gradient is the unsplit model's (torchtitan divides its expert gradients by the
same factor). Under FSDP2 the dense parameters are sharded over the ``edp × ep`` ranks as one
flattened dimension (``mesh.FLAT``) and the expert shards are left out of ``fully_shard``
(``ignored_params``), reduced here alike.

Tied parameters (``runtime.parallel.tied``) are not the wrappers': DDP is told to ignore them
(``_ddp_params_and_buffers_to_ignore``) and the tied sum reduces them over the owners of every
replica at the end of the step. FSDP2 is told the same (``fully_shard``'s ``ignored_params``): tied parameters stay whole on
every replica (``runtime.parallel.tied`` refuses one a caller's ``fully_shard`` sharded).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.runtime.parallel.expert_parallel import EXPERT_DATA, expert_parameters
from pipetrain.runtime.torch_compat import fsdp_post_backward

if TYPE_CHECKING:
    pass

KINDS = ("ddp", "fsdp")
REDUCTIONS = ("mean", "sum")


def check_wrapping(modules: dict[int, nn.Module], kind: str | None) -> None:
    """Refuse stages wrapped for data parallel where the pipeline would not drive the wrapper.

    FSDP is looked for only where it was imported (no module can be an ``FSDPModule`` before):
    importing ``torch.distributed.fsdp`` keeps the default group's store alive until the
    interpreter's own teardown, where rank 0 freeing its server aborted now and then."""
    from torch.nn.parallel import DistributedDataParallel

    fsdp = sys.modules.get("torch.distributed.fsdp")

    for s, module in modules.items():
        if isinstance(module, DistributedDataParallel):
            raise ValueError(
                f"stage {s} is wrapped in DistributedDataParallel, which would all-reduce partial "
                "gradients on every micro-batch; pass the plain module with "
                "mesh=..., data_parallel='ddp' and the Pipeline wraps it and syncs once per step"
            )
        if (
            kind != "fsdp"
            and fsdp
            and any(isinstance(m, fsdp.FSDPModule) for m in module.modules())
        ):
            raise ValueError(
                f"stage {s} contains fully_shard modules, which would reduce-scatter partial "
                "gradients on every micro-batch; pass mesh=..., data_parallel='fsdp' so the "
                "Pipeline syncs and reshards once per step"
            )


class DataParallel:
    """The replicas of this rank's stages and the once-a-step sync (see the module docstring).

    ``modules``: stage index -> module, already on its device. With ``"ddp"`` each is wrapped in
    ``DistributedDataParallel`` on ``dp_group`` (kept in ``wrappers``; the stage keeps running the
    plain module, whose parameter names stay unprefixed). With ``"fsdp"`` each is passed to
    ``fully_shard`` on ``dp_mesh`` unless it already is an FSDP module (apply ``fully_shard``
    yourself first for per-layer sharding or a mixed-precision policy); parameters are then
    sharded ``DTensor``s between steps, and the optimizer must be built after the ``Pipeline``.
    """

    @classmethod
    def build(
        cls,
        kind: str | None,
        modules: dict[int, nn.Module],
        dp_group,
        dp_mesh,
        device: torch.device,
        loss_reduction: str,
        tied_sets: Sequence,
    ) -> DataParallel | None:
        """The replicas ``Pipeline`` asked for (``None``: none): a loss that sums, or means over the
        global token count, adds the replicas' gradients; tied parameters are left to
        ``runtime.parallel.tied``, which reduces them over owners and replicas at once."""
        if kind is None:
            return None
        if kind == "fsdp" and tied_sets and dist.get_backend(dp_group) == "nccl":
            # Exact on gloo (tests), but a pp=2 x dp=2 zbv run on 4 GPUs hung before its first
            # step (docs/training-gpu.md): refused until that is understood, never a hang.
            raise ValueError(
                "tied weights with data_parallel='fsdp' on NCCL are not supported yet (a 4-GPU "
                "run hung); use data_parallel='ddp' or untie the weights"
            )
        reduction = "mean" if loss_reduction == "mean" else "sum"
        tied = frozenset(id(p) for t in tied_sets for p in t.local)
        return cls(kind, modules, dp_group, dp_mesh, device, reduction=reduction, tied=tied)

    def __init__(
        self,
        kind: str,
        modules: dict[int, nn.Module],
        dp_group,
        dp_mesh,
        device: torch.device,
        reduction: str = "mean",
        tied: frozenset[int] = frozenset(),
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"data_parallel={kind!r}; legal values: {', '.join(KINDS)}")
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction={reduction!r}; legal values: {', '.join(REDUCTIONS)}")
        self.kind = kind
        self.reduction = reduction
        #: ids of tied parameters: ``runtime.parallel.tied`` reduces them over owners × replicas
        self.tied = tied
        self.modules = modules
        self.group = dp_group
        self.size = dist.get_world_size(dp_group)
        self.device = device
        self.wrappers: dict[int, Any] = {}
        self._finished: set[int] = set()
        self._held: dict[int, list] = {}  # DDP: gradients from earlier steps, per stage
        #: per stage, its expert-parallel shards (reduced over ``edp`` by ``finish``)
        self.experts = {s: expert_parameters(m) for s, m in modules.items()}
        if kind == "ddp":
            ids = [device.index] if device.type == "cuda" else None
            for s, module in modules.items():
                if any(True for _ in self._trainable(module)):
                    alone = tied | {id(p) for p in self.experts[s]}
                    self.wrappers[s] = _ddp_without(
                        module, alone, device_ids=ids, process_group=dp_group
                    )
                    _broadcast_experts(self.experts[s])
                    if reduction == "sum":
                        self.wrappers[s].register_comm_hook(dp_group, _all_reduce_sum)
        else:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            for s, module in modules.items():
                if not any(True for _ in self._trainable(module)):
                    continue
                if not isinstance(module, FSDPModule):
                    alone = tied | {id(p) for p in self.experts[s]}
                    ignored = {p for p in module.parameters() if id(p) in alone}
                    fully_shard(module, mesh=dp_mesh, ignored_params=ignored or None)
                _broadcast_experts(self.experts[s])
                self.wrappers[s] = module
                # gloo has no AVG or PREMUL_SUM, which FSDP2 picks in float32 and bfloat16: sum,
                # then divide (what it does in float64 anyway)
                gloo = dist.get_backend(dp_group) == "gloo"
                for m in _fsdp_modules(module):
                    m.set_reshard_after_forward(False, recurse=False)
                    if reduction == "sum":
                        m.set_gradient_divide_factor(1.0)
                    if gloo:
                        m.set_force_sum_reduction_for_comms(True)

    # -- a step ---------------------------------------------------------------------------------

    def check_batch(self, rows: int) -> None:
        """Every replica must step on the same number of rows where the replicas are averaged
        (``reduction="mean"``; a summed loss weighs each row by itself)."""
        if self.size == 1 or self.reduction == "sum":
            return
        value = torch.tensor([rows, -rows], dtype=torch.float64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        most, fewest = int(value[0].item()), int(-value[1].item())
        if most != fewest:
            raise ValueError(
                f"data-parallel replicas stepped on local batches of {fewest} to {most} rows; "
                "give every replica the same number of rows (the gradient average and the "
                "returned loss weigh replicas equally)"
            )

    def begin(self, train: bool = True) -> None:
        """Before the step's first forward: FSDP gathers its parameters, sync and reshard off
        (for a forward-only pass, only the gathering)."""
        self._finished.clear()
        if train:
            # Gradients accumulated by earlier steps are synced already: set them aside, so the
            # reduction sees this step's alone (a summed reduction would count them again).
            # FSDP2 does so for what it shards; the expert shards are reduced here.
            self._held = {}
            for s in self.wrappers:
                mine = self._trainable(self.modules[s]) if self.kind == "ddp" else self.experts[s]
                held = [(p, p.grad) for p in mine if p.grad is not None]
                for p, _ in held:
                    p.grad = None
                self._held[s] = held
        if self.kind != "fsdp":
            return
        for module in self.wrappers.values():
            for m in _fsdp_modules(module):
                m.unshard()
            module.set_requires_gradient_sync(False)
            module.set_reshard_after_backward(False)
            module.set_is_last_backward(False)

    def finish(self, stage: int) -> None:
        """After ``stage``'s last backward piece of the step: its one gradient sync."""
        if stage in self._finished or stage not in self.wrappers:
            return
        self._finished.add(stage)
        module = self.modules[stage]
        params = list(self._trainable(module))
        sharded = {id(p) for p in self.experts[stage]}
        missing = [
            n
            for n, p in module.named_parameters()
            if p.requires_grad and p.grad is None and id(p) not in self.tied | sharded
        ]
        if missing:
            raise ValueError(
                f"stage {stage}: trainable parameter {missing[0]!r} got no gradient this step; "
                "with data parallel every trainable parameter must be used in every step "
                "(freeze it with requires_grad_(False))"
            )
        if self.kind == "ddp":
            ddp = self.wrappers[stage]
            ddp.reducer.prepare_for_backward([])
            experts = {id(p) for p in self.experts[stage]}
            dense = [p for p in params if id(p) not in experts]
            zeros = [p.new_zeros(()).expand_as(p) for p in dense]
            torch.autograd.backward(dense, zeros)
            self._reduce_experts(stage)
            for p, earlier in self._held.pop(stage, ()):
                p.grad.add_(earlier)
        else:
            _fsdp_post_backward(self.wrappers[stage])
            self._reduce_experts(stage)
            for p, earlier in self._held.pop(stage, ()):
                p.grad.add_(earlier)

    @torch.no_grad()
    def _reduce_experts(self, stage: int) -> None:
        """``stage``'s expert shards' gradients summed over ``edp`` (zero where no token reached
        this rank's experts this step), divided by the whole data-parallel size where the
        replicas are averaged (see the module docstring)."""
        for p in self.experts[stage]:
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            shard: Any = p.grad  # a DTensor, placed like the parameter
            local = shard.to_local()
            group = shard.device_mesh.get_group(EXPERT_DATA)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(local, group=group)
            if self.reduction == "mean":
                local.div_(self.size)

    def finish_all(self) -> None:
        """Sync every stage not synced yet (in stage order: the same order on every replica)."""
        for stage in sorted(self.wrappers):
            self.finish(stage)

    def end_eval(self) -> None:
        """After a forward-only pass: FSDP frees the gathered parameters again."""
        if self.kind == "fsdp":
            for module in self.wrappers.values():
                for m in _fsdp_modules(module):
                    m.reshard()

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global batch's loss: the mean of the replicas' (equal local batches), or their
        sum with ``reduction="sum"``."""
        if self.size == 1:
            return loss
        value = loss.detach().to(torch.float64).reshape(1).clone()
        dist.all_reduce(value, group=self.group)
        if self.reduction == "mean":
            value /= self.size
        return value[0].to(loss.dtype)

    def _trainable(self, module: nn.Module) -> Iterator[nn.Parameter]:
        """The trainable parameters this wrapper syncs (tied ones are ``runtime.parallel.tied``'s)."""
        seen: set[int] = set(self.tied)
        for p in module.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                yield p


def _broadcast_experts(params: list[nn.Parameter]) -> None:
    """Every ``edp`` replica of an expert shard starts from ``edp`` coordinate 0's values (what
    DDP's construction does for the parameters it owns)."""
    with torch.no_grad():
        for p in params:
            shard: Any = p  # a DTensor
            group = shard.device_mesh.get_group(EXPERT_DATA)
            if dist.get_world_size(group) > 1:
                source = dist.get_global_rank(group, 0)
                dist.broadcast(shard.to_local(), src=source, group=group)


def _all_reduce_sum(group, bucket):  # no annotations: DDP compares them as objects, not strings
    """A DDP comm hook: the bucket summed over the group (DDP's default divides by its size)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _ddp_without(module: nn.Module, ignored: frozenset[int], **kwargs) -> Any:
    """``DistributedDataParallel`` of ``module`` leaving the parameters ``ignored`` alone (DDP's
    ``_ddp_params_and_buffers_to_ignore``, set only while DDP reads it, added to the caller's)."""
    from torch.nn.parallel import DistributedDataParallel

    key = "_ddp_params_and_buffers_to_ignore"
    names = {n for n, p in module.named_parameters(remove_duplicate=False) if id(p) in ignored}
    if not names:
        return DistributedDataParallel(module, **kwargs)
    before = getattr(module, key, None)
    setattr(module, key, names | set(before or ()))
    try:
        return DistributedDataParallel(module, **kwargs)
    finally:
        if before is None:
            delattr(module, key)
        else:
            setattr(module, key, before)


def _fsdp_modules(module: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def _fsdp_post_backward(module: Any) -> None:
    """End an FSDP2 stage's step: sync, reshard and last-backward on, then the post-backward
    (``torch_compat.fsdp_post_backward``: private FSDP2 state)."""
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    fsdp_post_backward(module)
