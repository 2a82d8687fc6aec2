"""The pipeline dimension of an N-D ``DeviceMesh``: which groups each transfer and reduction uses.

A job that needs a pipeline usually also needs tensor parallel inside a node and data parallel
(FSDP2, or HSDP: replicated across groups of shards) across replicas — torchtitan and
Megatron-LM lay the ranks out as one mesh. ``Pipeline(mesh=...)`` takes that mesh; its
dimension names say what each one is:

* ``"pp"`` (required): the pipeline. Stage-to-stage transfers run on this rank's ``pp`` line
  of the mesh, so tensor-parallel rank ``t`` of a stage sends to tensor-parallel rank ``t`` of
  the next — each its own part of the activation (a sequence-parallel one stays sharded on the
  wire).
* ``"tp"``: tensor parallel inside every stage, applied by the caller with torch's
  ``parallelize_module`` on ``mesh["tp"]`` before the ``Pipeline`` is built; the pipeline only
  has to count each shard once where it reduces over the model (the gradient norm).
* ``"dp"``, or ``("dp_replicate", "dp_shard")`` for HSDP: data-parallel replicas of every
  stage (``runtime.parallel.data_parallel``), each stepping on its own part of the batch.
* ``("edp", "ep")`` instead of ``"dp"``: data parallel of ``edp × ep`` replicas whose routed
  experts are sharded over ``ep`` (``runtime.parallel.expert_parallel``, applied by the caller on
  ``mesh["edp", "ep"]`` before the ``Pipeline`` is built): expert parallel borrows from data
  parallel, as in torchtitan and Megatron-Core. Dense parameters reduce over both dimensions,
  experts over ``edp`` only.

Every reduction that spans the model counts each element once: ``norm_share`` keeps a gradient's
local part on this rank only where no other rank holds the same values (it is sharded along
every dimension where this rank's coordinate is not 0), so summing over every dimension's group
(``norm_groups``) adds each element exactly once — the rule that keeps tensor-parallel replicas
from clipping by different norms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

PIPELINE = "pp"
TENSOR = "tp"
DATA = "dp"
HSDP = ("dp_replicate", "dp_shard")
#: data parallel factored for expert parallel (``runtime.parallel.expert_parallel``)
EXPERT_DP = ("edp", "ep")
SUPPORTED = (PIPELINE, TENSOR, DATA, *HSDP, *EXPERT_DP)
#: the one dimension FSDP2 shards over under expert parallel: ``("edp", "ep")`` flattened
FLAT = "edp_ep"
#: flattened dimensions by the mesh dimensions they stand for
FLATTENED = {FLAT: EXPERT_DP}


@dataclass(frozen=True)
class MeshGroups:
    """What a ``Pipeline`` takes from its mesh (``resolve_mesh``)."""

    #: the ranks holding this rank's (dp, tp) coordinate in every stage: the pipeline's group
    pipeline: Any
    #: this rank's tensor-parallel sub-mesh, or None
    tensor: Any
    #: every data-parallel replica of this rank's stages (token counts, the loss), or None
    data: Any
    #: what the data-parallel wrapper shards or replicates over: ``mesh["dp"]``, or the 2-D
    #: ``mesh["dp_replicate", "dp_shard"]`` for HSDP, or ``mesh["edp", "ep"]`` for expert
    #: parallel; None without data parallel
    data_mesh: Any
    #: this rank's coordinate along every dimension but ``pp``
    coordinates: dict[str, int]
    #: one group per dimension but ``pp``, in the mesh's order
    groups: dict[str, Any]
    #: the number of processes in the mesh
    size: int = 1

    def norm_groups(self) -> list[Any]:
        """The groups a model-wide sum runs over besides the pipeline's: every other dimension
        (``norm_share`` makes each element count on one rank only)."""
        return [self.groups[name] for name in self.groups]


def resolve_mesh(mesh: Any, data_parallel: str | None) -> MeshGroups:
    """The groups of ``mesh`` for a pipeline, after refusing what it cannot run exactly: a mesh
    without ``"pp"``, a dimension it does not know, ``"dp"`` beside HSDP's pair, one of the pair
    alone, a data-parallel dimension without ``data_parallel`` (or the reverse), HSDP or tensor
    parallel under DDP."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
    if PIPELINE not in names:
        raise ValueError(
            f"mesh must be a DeviceMesh with a 'pp' dimension and any of 'tp', 'dp', "
            f"('dp_replicate', 'dp_shard') or ('edp', 'ep'), got mesh_dim_names "
            f"{names or None}; e.g. "
            "init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=('dp', 'pp', 'tp'))"
        )
    unknown = [n for n in names if n not in SUPPORTED]
    if unknown:
        raise ValueError(
            f"mesh dimension {unknown[0]!r} is not supported; a pipeline's mesh has 'pp' and "
            f"any of 'tp', 'dp', ('dp_replicate', 'dp_shard') or ('edp', 'ep'), got {names}"
        )
    hsdp = [n for n in HSDP if n in names]
    if hsdp and len(hsdp) != 2:
        raise ValueError(f"HSDP needs both 'dp_replicate' and 'dp_shard' dimensions, got {names}")
    expert = _check_expert_dims(names, data_parallel)
    if hsdp and DATA in names:
        raise ValueError(f"a mesh has 'dp' or ('dp_replicate', 'dp_shard'), not both: {names}")
    if data_parallel not in (None, "ddp", "fsdp"):
        raise ValueError(f"data_parallel={data_parallel!r}; legal values: ddp, fsdp")
    has_data = DATA in names or bool(hsdp) or expert
    if has_data and data_parallel is None:
        raise ValueError(
            f"mesh= and data_parallel= go together when the mesh has a data-parallel dimension "
            f"({names}): pass data_parallel='ddp' or 'fsdp'"
        )
    if not has_data and data_parallel is not None:
        raise ValueError(
            f"data_parallel={data_parallel!r} needs a 'dp' (or 'dp_replicate' and 'dp_shard') "
            f"dimension in the mesh, got {names}"
        )
    if data_parallel == "ddp" and (hsdp or TENSOR in names):
        what = "HSDP" if hsdp else "tensor parallel"
        raise ValueError(
            f"data_parallel='ddp' with {what} is not supported (DDP replicates plain "
            "parameters); use data_parallel='fsdp'"
        )
    others = [n for n in names if n != PIPELINE]
    groups = {n: mesh.get_group(n) for n in others}
    coordinates = {n: mesh.get_local_rank(n) for n in others}
    data_mesh = mesh[HSDP] if hsdp else mesh[DATA] if DATA in names else None
    data = None
    if expert:
        # DDP reduces over the flat group; FSDP2 shards the dense parameters over the same
        # ranks as one dimension (``FLAT``), the experts being left to expert parallel
        data_mesh = mesh[EXPERT_DP] if data_parallel == "ddp" else mesh[EXPERT_DP]._flatten(FLAT)
        data = _flat_group(mesh, EXPERT_DP)
    elif hsdp:
        data = _flat_group(mesh, HSDP)
    elif DATA in names:
        data = groups[DATA]
    return MeshGroups(
        pipeline=mesh.get_group(PIPELINE),
        tensor=mesh[TENSOR] if TENSOR in names else None,
        data=data,
        data_mesh=data_mesh,
        coordinates=coordinates,
        groups=groups,
        size=mesh.mesh.numel(),
    )


def _check_expert_dims(names: tuple[str, ...], data_parallel: str | None) -> bool:
    """Whether the mesh factors data parallel for expert parallel, after refusing what it
    cannot run: one of the pair alone, the pair beside another data-parallel dimension, tensor
    parallel (experts would need expert tensor parallel)."""
    pair = [n for n in EXPERT_DP if n in names]
    if not pair:
        return False
    if len(pair) != 2:
        raise ValueError(f"expert parallel needs both 'edp' and 'ep' dimensions, got {names}")
    if DATA in names or any(n in names for n in HSDP):
        raise ValueError(
            f"a mesh has 'dp', ('dp_replicate', 'dp_shard') or ('edp', 'ep'), not two: {names}"
        )
    if TENSOR in names:
        raise ValueError(
            "expert parallel with tensor parallel needs expert tensor parallel, which pipetrain "
            "does not have yet; drop the 'tp' dimension (--tp 1)"
        )
    return True


def _flat_group(mesh: Any, dims: tuple[str, ...]) -> Any:
    """One group over ``dims`` of ``mesh`` together (collective: every rank of the mesh calls
    it and makes every such group, in the same order, as ``new_group`` requires)."""
    names = list(mesh.mesh_dim_names)
    ranks = mesh.mesh.permute(
        *[names.index(n) for n in names if n not in dims], *[names.index(n) for n in dims]
    )
    lines = ranks.reshape(-1, int(torch.tensor([mesh.size(names.index(n)) for n in dims]).prod()))
    mine, _ = dist.new_subgroups_by_enumeration([row.tolist() for row in lines])
    return mine


def norm_share(grad: torch.Tensor, coordinates: dict[str, int]) -> torch.Tensor | None:
    """The part of ``grad`` this rank counts in a model-wide sum, or None where another rank
    counts the same values.

    A ``DTensor`` gradient counts its local shard along the dimensions it is sharded over (a
    flattened dimension, ``FLAT``, standing for the dimensions it was made of); a
    pending sum (``Partial``, e.g. a sequence-parallel norm's weight) is reduced first. Along
    every other dimension of the mesh the values are the same on every coordinate, and only
    coordinate 0 counts them. A ``DTensor`` on a mesh whose dimensions the pipeline's mesh does
    not name is refused: its shards could not be counted once."""
    from torch.distributed.tensor import DTensor, Replicate

    sharded: set[str] = set()
    if isinstance(grad, DTensor):
        mesh_names = grad.device_mesh.mesh_dim_names or ()
        parts = {n: FLATTENED.get(n, (n,)) for n in mesh_names}
        outside = [n for n in mesh_names if any(d not in coordinates for d in parts[n])]
        if not mesh_names or outside:
            raise ValueError(
                f"a gradient is a DTensor on mesh dimensions {mesh_names or None} that the "
                f"Pipeline's mesh does not have (it knows {sorted(coordinates) or 'only pp'}); "
                "pass the whole DeviceMesh as Pipeline(mesh=...) and parallelize on its "
                "sub-meshes (mesh['tp']), so each shard is counted once"
            )
        if any(p.is_partial() for p in grad.placements):
            grad = grad.redistribute(
                grad.device_mesh,
                [Replicate() if p.is_partial() else p for p in grad.placements],
            )
        # every placement left but Replicate splits the values (Shard, and FSDP2's strided
        # shard of a tensor-parallel shard, which is not a Shard subclass)
        sharded = {
            d for n, p in zip(mesh_names, grad.placements) if not p.is_replicate() for d in parts[n]
        }
        grad = grad.to_local()
    if any(c != 0 and n not in sharded for n, c in coordinates.items()):
        return None
    return grad


def refuse_dtensors_without_mesh(modules: dict[int, Any]) -> None:
    """Parameters that are DTensors on a mesh the pipeline was not given (``group=`` with a
    tensor-parallel model): each rank would count only its own shards in the gradient norm."""
    from torch.distributed.tensor import DTensor

    for s, module in modules.items():
        for name, p in module.named_parameters():
            if isinstance(p, DTensor):
                raise ValueError(
                    f"stage {s} parameter {name!r} is a DTensor (tensor parallel or "
                    "fully_shard applied before the Pipeline); pass the DeviceMesh it lives "
                    "on as Pipeline(mesh=...), with a 'pp' dimension, instead of group="
                )


__all__ = ["SUPPORTED", "MeshGroups", "norm_share", "refuse_dtensors_without_mesh", "resolve_mesh"]
