"""What a ``Pipeline`` runs, resolved before it runs anything.

Everything here is decided once, at construction (or in ``Pipeline.from_plan``, before it), and
never touches a transfer: that torch.distributed is up, the process groups (given, or a mesh's),
the stage count, the device, the checked and lowered program, this rank's modules, the second
NCCL group, the side stream, what each rank's row asks of its stages (where weight-gradient hooks
fire, where a stage's data-parallel sync may start), the forward-only program of ``eval_step``,
and a plan's layout turned into ``Pipeline`` arguments. It is apart from ``runtime.pipeline`` so
that module holds only what a step does and the order construction takes; every refusal here
names the legal values and comes before any peer waits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.planner.layout import Layout, PlanLike, layout_of
from pipetrain.runtime.backward.activation_checkpoint import recompute_stages
from pipetrain.runtime.layers import split
from pipetrain.runtime.parallel.mesh import MeshGroups, resolve_mesh
from pipetrain.schedule import deps
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.copy_engine import has_copies
from pipetrain.schedule.lower import lower, post_receives_late
from pipetrain.schedule.offload import OffloadSpec, check_fractions, insert_offload
from pipetrain.schedule.posted_p2p import run_posted
from pipetrain.schedule.program import Program
from pipetrain.schedule.validate import validate

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_log = logging.getLogger(__name__)

Stages = Sequence[nn.Module] | Callable[[int], nn.Module]
DataParallelKind = Literal["ddp", "fsdp"]


#: what ``Pipeline(offload=...)`` takes: per-stage fractions, or fractions with reload leads
Offload = Sequence[float] | OffloadSpec | None


@dataclass(frozen=True)
class Groups:
    """The process groups a pipeline runs on: its own ranks (``pipeline``; ``None``: the default
    group) and, with a mesh, this rank's data-parallel replicas (``replicas``, and ``replica_mesh``
    for FSDP2, which shards over a mesh rather than a group) and the whole mesh's groups
    (``mesh``: every reduction over the model spans them)."""

    pipeline: dist.ProcessGroup | None
    replicas: dist.ProcessGroup | None = None
    replica_mesh: DeviceMesh | None = None
    mesh: MeshGroups | None = None


def resolve_groups(
    group: dist.ProcessGroup | None,
    mesh: DeviceMesh | None,
    data_parallel: DataParallelKind | None,
) -> Groups:
    """``group`` alone, or a mesh with a ``"pp"`` dimension (``runtime.parallel.mesh``, which
    refuses what it cannot run): never both, and ``data_parallel`` only with a mesh."""
    if mesh is None:
        if data_parallel is not None:
            raise ValueError(
                f"data_parallel={data_parallel!r} needs mesh=: a DeviceMesh with a 'pp' and a "
                "'dp' (or 'dp_replicate' and 'dp_shard') dimension"
            )
        return Groups(group)
    if group is not None:
        raise ValueError("pass either group= or mesh= (whose 'pp' dimension is the group)")
    found = resolve_mesh(mesh, data_parallel)
    return Groups(found.pipeline, found.data, found.data_mesh, found)


def last_weight_pieces(row: Sequence[Action]) -> dict[int, int]:
    """Per stage, the micro-batch of the last action in ``row`` that makes weight gradients
    (a B, a W, or the B of an overlapped pair): where ``AccumulateGrad`` hooks should fire."""
    last: dict[int, int] = {}
    for action in row:
        if action.is_compute:
            for token, stage, microbatch in deps.produces(action):
                if token is deps.Token.WEIGHT_GRAD:
                    last[stage] = microbatch
    return last


def split_backward_stages(row: Sequence[Action]) -> set[int]:
    """The stages whose backward ``row`` splits into ``I`` and ``W`` (the zero-bubble family)."""
    return {p.stage for a in row for p in a.compute_parts if p.kind in (OpKind.I, OpKind.W)}


def last_uses(row: Sequence[Action]) -> dict[Action, tuple[int, ...]]:
    """The stages whose last compute action in ``row`` each action is."""
    last: dict[int, Action] = {}
    for action in row:
        for part in action.compute_parts:
            last[part.stage] = action
    uses: dict[Action, tuple[int, ...]] = {}
    for stage, action in sorted(last.items()):
        uses[action] = (*uses.get(action, ()), stage)
    return uses


def require_process_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed is not initialized: call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) (or launch with "
            "torchrun) before building or stepping a Pipeline"
        )


def reverse_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A second group of the same ranks for transfers to lower ranks, where the backend runs a
    pair's operations on one stream in order (NCCL; see ``p2p``); ``None`` elsewhere (gloo
    matches by tag and never holds a send behind a receive)."""
    if dist.get_world_size(group) < 2 or dist.get_backend(group) != "nccl":
        return None
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    return dist.new_group(ranks, backend="nccl", use_local_synchronization=True)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        import os

        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def count_stages(stages: Stages, num_stages: int | None) -> int:
    if callable(stages) and not isinstance(stages, (nn.Module, Sequence)):
        if num_stages is None:
            raise ValueError("stages is a callable stage_index -> nn.Module; pass num_stages=")
        return num_stages
    if isinstance(stages, nn.Module) and not isinstance(stages, (nn.Sequential, nn.ModuleList)):
        raise ValueError("stages must be a sequence of nn.Module (one per stage) or a callable")
    n = len(stages)
    if num_stages is not None and num_stages != n:
        raise ValueError(f"num_stages={num_stages} but {n} stages were given")
    return n


def resolve_program(
    schedule: str | Program,
    num_microbatches: int | None,
    total: int,
    world: int,
    stages_per_rank: int | None,
    receive_lead: int | None = 1,
    offload: Offload = None,
) -> Program:
    if isinstance(schedule, Program):
        program = schedule
        if num_microbatches is not None and num_microbatches != program.num_microbatches:
            raise ValueError(
                f"num_microbatches={num_microbatches} but the program has "
                f"{program.num_microbatches}; omit it or make them agree"
            )
    else:
        from pipetrain.schedule.registry import build_schedule

        if num_microbatches is None:
            raise ValueError("num_microbatches is required with a schedule name")
        if total % world:
            raise ValueError(
                f"{total} stages cannot be spread over {world} ranks; the stage count must be a "
                "multiple of the world size"
            )
        v = stages_per_rank if stages_per_rank is not None else total // world
        if v * world != total:
            raise ValueError(
                f"stages_per_rank={v} × {world} ranks = {v * world} stages, but {total} were given"
            )
        try:
            program = build_schedule(schedule, world, num_microbatches, stages_per_rank=v)
        except ValueError as e:
            raise ValueError(f"{total} stages on {world} ranks ({v} per rank): {e}") from None
    if program.placement.num_chains > 1:
        raise ValueError(
            f"{program.name} runs {program.placement.num_chains} copies of the model "
            "(bidirectional placement); the runtime runs programs with one copy: use dualpipev, "
            "DualPipe's one-copy V variant"
        )
    if program.num_ranks != world:
        raise ValueError(
            f"the program has {program.num_ranks} ranks but the process group has {world}; "
            f"launch {program.num_ranks} processes"
        )
    if program.num_stages != total:
        raise ValueError(
            f"the schedule has {program.num_stages} stages but {total} stages were given"
        )
    program = validate(lower(program))
    program = _with_offload(program, offload, total)
    if receive_lead is None:
        return program
    # the moved receives are checked against the transport that runs them (``runtime.comm.p2p``)
    return validate(post_receives_late(program, receive_lead), "posted")


def offload_fractions(offload: Offload) -> Sequence[float] | None:
    """The per-stage fractions of ``Pipeline(offload=...)``, in either form."""
    return offload.fractions if isinstance(offload, OffloadSpec) else offload


def _with_offload(program: Program, offload: Offload, total: int) -> Program:
    """The program with its offload copies: inserted for ``offload``'s fractions (each stage's
    reloads its lead ahead of the backward), or the program's own (a program file may carry them;
    then ``offload`` says how much they move)."""
    leads = offload.leads(total) if isinstance(offload, OffloadSpec) else 1
    offload = offload_fractions(offload)
    fractions = check_fractions(offload, total) if offload is not None else None
    if has_copies(program):
        if fractions is None or not any(fractions):
            raise ValueError(
                "the program has OFFLOAD/RELOAD actions; pass offload= (per stage, the fraction "
                "of its saved activation bytes they move)"
            )
        return program
    if fractions is not None and any(fractions):
        return validate(insert_offload(program, fractions, leads))
    return program


def local_modules(
    stages: Stages, mine: tuple[int, ...], device: torch.device
) -> dict[int, nn.Module]:
    out: dict[int, nn.Module] = {}
    for s in mine:
        if isinstance(stages, (Sequence, nn.Module)):  # nn.Sequential / nn.ModuleList index too
            module = cast(Any, stages)[s]
        else:
            module = stages(s)
        if not isinstance(module, nn.Module):
            raise TypeError(f"stage {s} is a {type(module).__name__}, not an nn.Module")
        out[s] = module.to(device)
    return out


def forward_only(program: Program, receive_lead: int | None = None) -> Program:
    """The program's forwards alone (pair parts included), lowered again for eval, its receives
    moved as the training program's were (``receive_lead``).

    ``validate`` would reject it (no backward); ``lower``'s dependency walk is the run check, and
    the runtime transport's model (``posted_p2p``) checks the moved receives.
    """
    rows = tuple(
        tuple(
            Action(OpKind.F, p.stage, p.microbatch)
            for a in row
            if a.is_compute
            for p in a.compute_parts
            if p.kind is OpKind.F
        )
        for row in program.actions
    )
    lowered = lower(Program(program.placement, program.num_microbatches, rows, program.name))
    if receive_lead is None:
        return lowered
    moved = post_receives_late(lowered, receive_lead)
    run_posted(moved)
    return moved


def plan_stages(layers, layout: Layout, kwargs: dict) -> Callable[[int], nn.Module]:
    """``Pipeline.from_plan``'s stages, as a callable ``stage_index -> nn.Module``: ``layers``
    cut by the checked ``layout``'s ``stage_layers`` with ``pipetrain.split`` (each stage recomputing as ``layout.recompute``
    says: ``backward.activation_checkpoint.recompute_stages``) when the ``Pipeline`` first asks (where a failure is told to the peers), after refusing options the
    plan sets and a plan made for another number of pipeline ranks than this process group's
    (the mesh's ``pp`` dimension with ``mesh=``): its cut and its schedule were chosen for that
    size."""
    plan_sets = {"schedule", "num_microbatches", "stages_per_rank", "num_stages", "offload"}
    given = sorted(plan_sets & set(kwargs))
    if given:
        raise ValueError(f"the plan sets the schedule and its shape; drop {', '.join(given)}")
    require_process_group()
    if kwargs.get("mesh") is not None:
        world = kwargs["mesh"]["pp"].size()
    else:
        world = dist.get_world_size(kwargs.get("group"))
    if layout.ranks != world:
        raise ValueError(
            f"the plan is for {layout.ranks} pipeline ranks but the process group has "
            f"{world}; launch {layout.ranks} processes per pipeline, or plan again with "
            f"--ranks {world}"
        )
    counts = layout.stage_layers
    callable_form = callable(layers) and not isinstance(layers, (nn.Module, Sequence, dict))
    cut: list[Sequence[nn.Module]] = []

    def stage(index: int) -> nn.Module:
        # cut on first use, inside construction: a cut that fails on one rank reaches its peers
        if not cut:
            stages = split(layers, counts, num_layers=sum(counts) if callable_form else None)
            if layout.recomputes:
                stages = recompute_stages(stages, layout.recompute)
            cut.append(stages)
        return cut[0][index]

    return stage


def plan_layout(plan: PlanLike) -> Layout:
    """The ``Layout`` of a ``Plan`` (anything with a ``layout``), a ``Layout`` or a plan dict, checked (a ``ValueError`` names
    the first missing or bad field)."""
    return layout_of(plan)
