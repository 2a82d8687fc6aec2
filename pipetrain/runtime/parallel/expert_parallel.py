"""Expert parallel: each stage's routed experts sharded over its ``ep`` group, tokens sent to
the experts' owners with all-to-all and their outputs sent back.

The layout is torchtitan's, Megatron-Core's and DeepSpeed's: expert parallel *borrows* from data
parallel. The data-parallel ranks of a stage are factored as ``("edp", "ep")`` in the mesh
(``runtime.parallel.mesh``); the ``ep`` ranks of one ``edp`` row each hold ``E / ep`` of the
layer's ``E`` experts, and every replica still steps on its own micro-batches. Dense parameters
are replicated over the whole ``edp × ep`` grid and reduced over it; an expert's parameters live
on one ``ep`` rank of every ``edp`` row and are reduced over ``edp`` only
(``runtime.parallel.data_parallel``). Each sharded parameter is a ``DTensor`` on the
``("edp", "ep")`` sub-mesh placed ``(Replicate(), Shard(0))``: its global shape is the unsplit
model's, so DCP checkpoints reshard across ``ep`` sizes (and load into the unsplit model), the
Hugging Face export gathers it whole, and the gradient norm counts each expert once
(``mesh.norm_share``).

One MoE layer, one micro-batch (the dropless AllToAll dispatcher of Megatron-Core's
``token_dispatcher.py``, and torchtitan's ``expert_parallel.py``):

1. **Permute.** The router's top-k choice gives ``N·k`` (token, expert) pairs; a stable sort by
   expert id groups them by expert, hence by owner (experts are dealt out contiguously).
2. **Counts, once.** One small all-to-all of the per-expert counts tells every rank how many
   rows it receives from each peer for each of its experts; the split sizes of both exchanges
   below follow (a host sync, as in Megatron-Core's dispatcher: all-to-all needs them on the
   host).
3. **Dispatch.** ``all_to_all_single`` of the permuted hidden rows (autograd: ``_AllToAll``, whose
   backward is the reverse exchange).
4. **Local experts** (``local_experts``): the received rows, each with its local expert id,
   through the experts module's *own* forward (its implementation, eager loop or grouped GEMM,
   with ``num_experts`` set to the local count): top-1 with weight 1 per row, so the module's math
   is the unsplit model's.
5. **Combine.** The reverse all-to-all, then each row times its routing weight, added into its
   token in expert order (``index_add_``): the sum the unsplit module forms.

Token choice is dropless, as every family here defines it: no capacity, no padding. A rank whose
experts receive no row in a step gets a zero gradient for them (``data_parallel`` fills it), so
the reduction over ``edp`` never waits.

**One group per direction** (``DirectionGroups``). Every exchange above issued in a forward goes
to the ``ep`` group; every one issued inside a backward — ``_AllToAll``'s reverse exchange, and a
per-layer recompute's forward run again inside a backward — to a second group over the same
ranks. Which one is decided by whether autograd's engine runs the current code
(``torch_compat.in_backward``, what ``torch.utils.checkpoint`` asks), not by thread: on CUDA the
engine runs a backward on its own device threads. So an F&B pair whose forward runs on a lane of
its own while the backward runs on the caller (``runtime.pair_lanes``) never has both directions'
collectives on one group at once (one NCCL communicator runs its collectives on one stream in
issue order; gloo matches them by sequence). Why each group's collectives still meet in the
same order on every peer: the ``ep`` peers of a stage are data-parallel replicas with the same
pipeline coordinate, so they run the same rank program; actions are joined one after the other,
and within a pair only the forward lane uses the forward group and only the backward the
backward group, each issuing its layers' exchanges in its own deterministic order (a stage's
forward in layer order; a backward in the graph's order, the same graph on every peer). The
groups are used always, sequential runs too, so there is one code path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.runtime import torch_compat

#: the mesh dimensions expert parallel factors data parallel into
EXPERT_DATA, EXPERT = "edp", "ep"


class DirectionGroups:
    """Two process groups over one ``ep`` row's ranks: ``forward`` for collectives issued in a
    forward, ``backward`` for those issued inside a backward (module docstring)."""

    #: where a mesh keeps its pair (one per mesh object: its MoE layers share it)
    ATTRIBUTE = "_pipetrain_ep_direction_groups"

    def __init__(self, forward: Any, backward: Any) -> None:
        self.forward, self.backward = forward, backward

    @classmethod
    def of(cls, mesh: Any) -> DirectionGroups:
        """``mesh``'s pair: its ``ep`` group for forwards, and a group made now over the same
        ranks for backwards (the first time a mesh asks). Every member of the ``ep`` row asks at
        the same point of the same program (its layers are sharded in the same order), and only
        members take part (``use_local_synchronization``), so creation is collective per row."""
        found = mesh.__dict__.get(cls.ATTRIBUTE)
        if found is None:
            forward = mesh.get_group(EXPERT)
            ranks = dist.get_process_group_ranks(forward)
            backend = dist.get_backend(forward)
            backward = dist.new_group(
                ranks, backend=backend, use_local_synchronization=True, group_desc="ep_backward"
            )
            found = mesh.__dict__[cls.ATTRIBUTE] = cls(forward, backward)
        return found

    def now(self) -> Any:
        """The group for a collective issued here: ``backward`` inside autograd's engine."""
        return self.backward if torch_compat.in_backward() else self.forward

    def __deepcopy__(self, memo: dict) -> DirectionGroups:
        return self  # process groups are handles to the processes' connections: shared, not copied


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward sends the gradients back along the
    same routes (the exchange with the splits swapped), on the backward group."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], groups: Any
    ):
        ctx.splits, ctx.groups = (out_splits, in_splits), groups
        return _exchange(x, out_splits, in_splits, _group_now(groups))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        group = ctx.groups.backward if isinstance(ctx.groups, DirectionGroups) else ctx.groups
        return _exchange(grad, in_splits, out_splits, group), None, None, None


def _group_now(groups: Any) -> Any:
    """A ``DirectionGroups``' group for now, or the one group given."""
    return groups.now() if isinstance(groups, DirectionGroups) else groups


def _exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any):
    """Rows of ``x`` sent to each rank of ``group`` (``in_splits`` rows to each, in rank order),
    the rows received (``out_splits`` from each); differentiable. ``group``: a process group,
    or a ``DirectionGroups`` (forward and backward each on the group of their direction)."""
    result: torch.Tensor = _AllToAll.apply(x, out_splits, in_splits, group)
    return result


def local_experts(
    math: nn.Module, params: dict[str, torch.Tensor], rows: torch.Tensor, expert: torch.Tensor
) -> torch.Tensor:
    """Each row of ``rows`` through its local expert ``expert[i]``, with the experts module's own
    forward (``math``: the module, its parameters given as ``params``, its ``num_experts`` the
    local count): routed top-1 with weight 1, so its output row ``i`` is expert ``expert[i]``
    applied to row ``i``. The one place a grouped GEMM over the local experts goes (the module's
    own ``grouped_mm`` implementation where its config selects it)."""
    ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
    # the shards' local tensors as plain attributes for this call only (``functional_call``
    # would register them as parameters, which a DTensor's local view is taken for)
    held = math.__dict__
    held.update(params)
    try:
        out: torch.Tensor = math(rows, expert[:, None], ones)
    finally:
        for name in params:
            held.pop(name, None)
    return out


class ExpertParallelExperts(nn.Module):
    """A fused experts module (``gate_up_proj [E, ...]``, ``down_proj [E, ...]``, biases
    ``[E, ...]``; ``forward(hidden_states, top_k_index, top_k_weights)``, ``transformers``'
    layout) with its experts sharded over the ``ep`` dimension of ``mesh`` (the 2-D
    ``("edp", "ep")`` sub-mesh); the same parameter names, so state dicts keep the unsplit
    model's keys. ``experts`` becomes the math this module calls (its parameters move here)."""

    def __init__(self, experts: nn.Module, mesh: Any) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor, Replicate, Shard

        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if names != (EXPERT_DATA, EXPERT):
            raise ValueError(
                f"expert parallel shards over a ('edp', 'ep') mesh (mesh['edp', 'ep'] of the "
                f"pipeline's mesh), got mesh_dim_names {names or None}"
            )
        count = int(getattr(experts, "num_experts", 0) or 0)
        size = mesh.size(1)
        if count <= 0 or count % size:
            raise ValueError(
                f"--ep {size} must divide the number of experts ({count}); use an --ep that does"
            )
        self.num_experts, self.ep_size = count, size
        self.local_count = count // size
        self.ep_rank = mesh.get_local_rank(EXPERT)
        self.groups = DirectionGroups.of(mesh)
        first = self.ep_rank * self.local_count
        held = list(experts.named_parameters(recurse=False))
        odd = [n for n, p in held if p.dim() == 0 or p.shape[0] != count]
        if odd or not held:
            raise ValueError(
                f"{type(experts).__name__}: expert parallel shards parameters of shape "
                f"[{count}, ...]; {odd[0] if odd else 'none'!r} is not one"
            )
        for name, p in held:
            local = p.detach()[first : first + self.local_count].clone()
            shard = DTensor.from_local(local, mesh, [Replicate(), Shard(0)], run_check=False)
            self.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))
            del experts._parameters[name]
        experts.num_experts = self.local_count
        self.math = experts
        self._names = tuple(n for n, _ in held)
        #: called with each dispatch's rows to every rank and the hidden states they are taken
        #: from (``profile --ep`` counts the bytes a dispatch sends: ``profile_ep_measured``)
        self.dispatch_observer: Callable[[list[int], torch.Tensor], None] | None = None

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, ep={self.ep_size}, local={self.local_count}"

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        ids = top_k_index.reshape(-1)
        top_k = top_k_index.shape[-1]
        order = torch.argsort(ids, stable=True)
        # ids == num_experts mark "no expert" (transformers' sentinel): sorted last, never sent
        counts = torch.bincount(ids, minlength=self.num_experts + 1)[: self.num_experts]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.groups.now())
        send = counts.view(self.ep_size, self.local_count).sum(1).tolist()
        per_expert = received.view(self.ep_size, self.local_count)
        recv = per_expert.sum(1).tolist()
        if self.dispatch_observer is not None:
            self.dispatch_observer(send, hidden_states)
        order = order[: sum(send)]
        tokens = order // top_k
        rows = all_to_all(hidden_states[tokens], recv, send, self.groups)
        local_ids = torch.arange(self.local_count, device=ids.device).repeat(self.ep_size)
        expert = torch.repeat_interleave(local_ids, per_expert.reshape(-1))
        params = {n: getattr(self, n).to_local() for n in self._names}
        out = local_experts(self.math, params, rows, expert)
        back = all_to_all(out, send, recv, self.groups)
        weighted = back * top_k_weights.reshape(-1)[order, None]
        combined = torch.zeros_like(hidden_states)
        return combined.index_add_(0, tokens, weighted.to(hidden_states.dtype))


def shard_experts(layer: nn.Module, mesh: Any, names: Sequence[str] = ("mlp.experts",)) -> int:
    """Shard the experts modules at ``names`` in ``layer`` (a decoder layer, or any module
    holding them) over ``mesh``'s ``ep`` dimension (``ExpertParallelExperts``); names the layer
    lacks (a dense layer of an MoE model) are skipped. Returns how many it sharded. A family's
    expert-parallel plan (``pipetrain.hf.families``)."""
    done = 0
    for name in names:
        parent_name, _, child = name.rpartition(".")
        try:
            parent = layer.get_submodule(parent_name) if parent_name else layer
            found = parent.get_submodule(child)
        except AttributeError:
            continue
        if isinstance(found, ExpertParallelExperts):
            continue
        setattr(parent, child, ExpertParallelExperts(found, mesh))
        done += 1
    return done


def apply_expert_parallel(modules: nn.Module | Iterable[nn.Module], mesh: Any) -> int:
    """Shard every MoE layer's experts in ``modules`` (stages, or a layer list's values) over
    ``mesh``'s ``ep`` dimension, by each layer's family plan: the layers ``pipetrain.hf`` builds
    carry their family (``family.expert_parallel`` and ``family.experts``). Returns how many
    experts modules it sharded (none for a stage without MoE layers; ``--ep`` on a dense
    family is refused before launching, ``app.train_checks``)."""
    roots = [modules] if isinstance(modules, nn.Module) else list(modules)
    done = 0
    for root in roots:
        for layer in list(root.modules()):
            family: Any = getattr(layer, "family", None)
            plan = getattr(family, "expert_parallel", None)
            if plan is not None:
                done += plan(layer, mesh, family.experts)
    return done


def expert_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``module`` sharded by expert parallel (``DTensor``s on a mesh with an
    ``ep`` dimension), each once."""
    found: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        if isinstance(sub, ExpertParallelExperts):
            for p in sub.parameters(recurse=False):
                found.setdefault(id(p), p)
    return list(found.values())


__all__ = [
    "EXPERT",
    "EXPERT_DATA",
    "DirectionGroups",
    "ExpertParallelExperts",
    "all_to_all",
    "apply_expert_parallel",
    "expert_parameters",
    "local_experts",
    "shard_experts",
]
