"""The global gradient norm of a pipeline, and clipping by it like the unsplit model.

``torch.nn.utils.clip_grad_norm_`` on one rank's parameters sees only that rank's stages: each
rank would clip by its own, smaller norm. Here each rank reduces its gradients to one number (the
sum of squares for ``p = 2``, in general ``Σ|g|^p``; the maximum for ``inf``), the ranks combine
those over the pipeline group and every other dimension of the mesh, and every rank scales by
``max_norm / (norm + 1e-6)`` clamped to 1 — torch's formula. Each element counts once: a tied
parameter (``runtime.parallel.tied``) by its first owner, and across tensor- and data-parallel
ranks a shard by its holder, replicated values by coordinate 0 only (``mesh.norm_share``), so
tensor-parallel and data-parallel replicas clip by one norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.runtime.parallel.mesh import MeshGroups, norm_share

if TYPE_CHECKING:
    from pipetrain.runtime.parallel.tied import TiedSet


def counted_and_scaled(
    parameters: Iterable[nn.Parameter],
    tied: Iterable[TiedSet],
    rank: int,
    coordinates: dict[str, int],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(what this rank counts in the norm, the gradients it scales): a tied parameter is counted
    by its first owner only (``rank`` is this rank in the pipeline group), and across the mesh's
    other dimensions each element by one rank (``mesh.norm_share``: this rank's shard where the
    gradient is sharded, coordinate 0's values where it is replicated); every gradient is
    scaled."""
    skip: set[int] = set()
    for t in tied:
        for i, p in enumerate(t.local):
            if i > 0 or rank != t.first_owner:
                skip.add(id(p))
    params = list(parameters)
    grads = [p.grad for p in params if p.grad is not None]
    counted = []
    for p in params:
        if p.grad is not None and id(p) not in skip:
            share = norm_share(p.grad, coordinates)
            if share is not None:
                counted.append(share)
    return counted, grads


def local_total(
    grads: Iterable[torch.Tensor], norm_type: float, device: torch.device
) -> torch.Tensor:
    """This rank's share on ``device``: ``Σ|g|^p`` (float64), or ``max|g|`` for ``p = inf``.
    Per-tensor norms stay on the gradients' device (no host sync per parameter)."""
    local = grads  # already this rank's shares (``counted_and_scaled``)
    norms = [
        torch.linalg.vector_norm(g.detach(), norm_type).to(device, torch.float64) for g in local
    ]
    if not norms:
        return torch.zeros((), dtype=torch.float64, device=device)
    stacked = torch.stack(norms)
    return stacked.max() if math.isinf(norm_type) else (stacked**norm_type).sum()


def global_norm(
    grads: list[torch.Tensor], norm_type: float, groups: list, device: torch.device
) -> torch.Tensor:
    """The norm over every rank of each group in ``groups`` (``None``: the default group)."""
    value = local_total(grads, norm_type, device)
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    for group in groups:  # None is the default (world) group
        if dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=op, group=group)
    return value if math.isinf(norm_type) else value ** (1.0 / norm_type)


@torch.no_grad()
def clip_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))`` (torch's rule)."""
    if not grads:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device, g.dtype))


def clip_pipeline(
    params: Iterable[nn.Parameter],
    tied_sets: Sequence[TiedSet],
    rank: int,
    mesh: MeshGroups | None,
    group: dist.ProcessGroup | None,
    device: torch.device,
    max_norm: float,
    norm_type: float,
) -> torch.Tensor:
    """``Pipeline.clip_grad_norm_``: this rank's share of the norm (``counted_and_scaled``), summed
    over the pipeline's group and the mesh's other dimensions, then every gradient clipped by it;
    returns the norm."""
    coordinates = mesh.coordinates if mesh is not None else {}
    counted, scaled = counted_and_scaled(params, tied_sets, rank, coordinates)
    others = mesh.norm_groups() if mesh is not None else []
    total = global_norm(counted, float(norm_type), [group, *others], device)
    clip_(scaled, total, max_norm)
    return total
