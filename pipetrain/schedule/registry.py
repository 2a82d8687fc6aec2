"""The schedule registry: every family by name, its one-line summary, constraints and builder.

``ScheduleSpec`` describes a schedule (it never behaves); ``build`` validates it once and hands it
to the family's builder. The CLI, the runtime and the benchmarks all go through here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from pipetrain.schedule.builders.controllable_memory import build_v_half, build_v_min
from pipetrain.schedule.builders.dualpipe import build_dualpipe
from pipetrain.schedule.builders.dualpipev import build_dualpipev
from pipetrain.schedule.builders.gpipe import build_gpipe
from pipetrain.schedule.builders.interleaved import (
    build_interleaved_1f1b,
    build_interleaved_zb,
    build_looped_bfs,
)
from pipetrain.schedule.builders.one_f_one_b import build_1f1b
from pipetrain.schedule.builders.zbv import build_zbv
from pipetrain.schedule.builders.zero_bubble import build_zb_h1, build_zb_h2
from pipetrain.schedule.gc_pause import without_gc
from pipetrain.schedule.program import Program


class ScheduleName(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LOOPED_BFS = "looped-bfs"
    ZB_H1 = "zb-h1"
    ZB_H2 = "zb-h2"
    INTERLEAVED_ZB = "interleaved-zb"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"
    DUALPIPE = "dualpipe"
    V_HALF = "v-half"
    V_MIN = "v-min"


@dataclass(frozen=True, kw_only=True)
class Family:
    name: ScheduleName
    summary: str
    constraints: str
    #: legal stages per rank; ``None`` means any integer >= 1
    stages_per_rank: tuple[int, ...] | None
    default_stages_per_rank: int
    builder: Callable[..., Program]
    takes_group_size: bool = False
    #: whether ``pipetrain.Pipeline`` runs it (DualPipe's two model copies it does not)
    runnable: bool = True

    @property
    def multi_stage(self) -> bool:
        return self.stages_per_rank is None

    def legal_stages_per_rank(self) -> str:
        if self.stages_per_rank is None:
            return "any integer >= 1"
        return " or ".join(map(str, self.stages_per_rank))


FAMILIES: dict[ScheduleName, Family] = {
    f.name: f
    for f in (
        Family(
            name=ScheduleName.GPIPE,
            summary="all forwards, then all backwards (Huang et al. 2019)",
            constraints="1 stage per rank; any micro-batch count",
            stages_per_rank=(1,),
            default_stages_per_rank=1,
            builder=build_gpipe,
        ),
        Family(
            name=ScheduleName.ONE_F_ONE_B,
            summary="warm-up, one forward / one backward, cool-down (PipeDream-flush, Megatron)",
            constraints="1 stage per rank; any micro-batch count",
            stages_per_rank=(1,),
            default_stages_per_rank=1,
            builder=build_1f1b,
        ),
        Family(
            name=ScheduleName.INTERLEAVED_1F1B,
            summary="1F1B over v looped chunks per rank, depth-first (Narayanan et al. 2021)",
            constraints="v >= 1 stages per rank (default 2); any micro-batch count; group size G "
            "in [ranks, micro-batches] with micro-batches % G == 0 or micro-batches % G >= ranks (default: the "
            "smallest legal; G = micro-batches when fewer than ranks)",
            stages_per_rank=None,
            default_stages_per_rank=2,
            builder=build_interleaved_1f1b,
            takes_group_size=True,
        ),
        Family(
            name=ScheduleName.LOOPED_BFS,
            summary="every micro-batch through a local chunk before the next (Lamy-Poirier 2023)",
            constraints="v >= 1 stages per rank (default 2); any micro-batch count",
            stages_per_rank=None,
            default_stages_per_rank=2,
            builder=build_looped_bfs,
        ),
        Family(
            name=ScheduleName.ZB_H1,
            summary="zero-bubble H1: split backward, W deferred, 1F1B memory (Qi et al. 2024)",
            constraints="1 stage per rank; any micro-batch count",
            stages_per_rank=(1,),
            default_stages_per_rank=1,
            builder=build_zb_h1,
        ),
        Family(
            name=ScheduleName.ZB_H2,
            summary="zero-bubble H2: longer warm-up, no steady-state bubble, 2p-1 memory (Qi et al. 2024)",
            constraints="1 stage per rank; any micro-batch count",
            stages_per_rank=(1,),
            default_stages_per_rank=1,
            builder=build_zb_h2,
        ),
        Family(
            name=ScheduleName.INTERLEAVED_ZB,
            summary="interleaved 1F1B with split backward, W deferred into bubbles (torch)",
            constraints="v >= 1 stages per rank (default 2); as interleaved-1f1b",
            stages_per_rank=None,
            default_stages_per_rank=2,
            builder=build_interleaved_zb,
        ),
        Family(
            name=ScheduleName.ZBV,
            summary="zero-bubble V: two chunks per rank in a V, split backward (Qi et al. 2024 §6)",
            constraints="exactly 2 stages per rank (V placement); any micro-batch count",
            stages_per_rank=(2,),
            default_stages_per_rank=2,
            builder=build_zbv,
        ),
        Family(
            name=ScheduleName.DUALPIPEV,
            summary="DualPipe cut in half: V placement, overlapped F&B pairs (DeepSeek-V3 §3.2.1)",
            constraints="exactly 2 stages per rank (V placement); micro-batches >= 2 x ranks",
            stages_per_rank=(2,),
            default_stages_per_rank=2,
            builder=build_dualpipev,
        ),
        Family(
            name=ScheduleName.DUALPIPE,
            summary="DualPipe: two model copies fed from both ends, overlapped F&B pairs "
            "(DeepSeek-V3 §3.2.1)",
            constraints="2 stages per rank, one of each copy (parameters held twice); even "
            "ranks; even micro-batches >= 2 x ranks; plan and simulate only (the runtime runs "
            "one copy of the model)",
            stages_per_rank=(2,),
            default_stages_per_rank=2,
            builder=build_dualpipe,
            runnable=False,
        ),
        Family(
            name=ScheduleName.V_HALF,
            summary="V-Half: V blocks, half of 1F1B's activations and bubble (Qi et al. 2024, "
            "controllable memory)",
            constraints="exactly 2 stages per rank (V placement); any micro-batch count",
            stages_per_rank=(2,),
            default_stages_per_rank=2,
            builder=build_v_half,
        ),
        Family(
            name=ScheduleName.V_MIN,
            summary="V-Min: V blocks, a third of 1F1B's activations, 2/3 of its bubble (Qi et al. "
            "2024, controllable memory)",
            constraints="exactly 2 stages per rank (V placement); any micro-batch count",
            stages_per_rank=(2,),
            default_stages_per_rank=2,
            builder=build_v_min,
        ),
    )
}


def family(name: str) -> Family:
    try:
        return FAMILIES[ScheduleName(name)]
    except ValueError:
        raise ValueError(
            f"unknown schedule {name!r}; legal schedules: {', '.join(FAMILIES)}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class ScheduleSpec:
    """A schedule to build: family name and shape. ``stages_per_rank=None`` takes the default."""

    name: ScheduleName
    num_ranks: int
    num_microbatches: int
    stages_per_rank: int | None = None
    microbatch_group_size: int | None = None


@without_gc
def build(spec: ScheduleSpec) -> Program:
    """Build the compute-only program for ``spec``; ``ValueError`` names any illegal value."""
    fam = family(spec.name)
    v = fam.default_stages_per_rank if spec.stages_per_rank is None else spec.stages_per_rank
    if fam.stages_per_rank is not None and v not in fam.stages_per_rank:
        raise ValueError(
            f"{fam.name} needs stages_per_rank = {fam.legal_stages_per_rank()}, got {v}"
        )
    if spec.microbatch_group_size is not None and not fam.takes_group_size:
        raise ValueError(f"{fam.name} takes no micro-batch group size; only interleaved-1f1b does")
    kwargs: dict[str, int] = {}
    if fam.multi_stage:
        kwargs["stages_per_rank"] = v
    if spec.microbatch_group_size is not None:
        kwargs["microbatch_group_size"] = spec.microbatch_group_size
    return fam.builder(spec.num_ranks, spec.num_microbatches, **kwargs)


def build_schedule(
    name: str,
    num_ranks: int,
    num_microbatches: int,
    stages_per_rank: int | None = None,
    microbatch_group_size: int | None = None,
) -> Program:
    """Convenience: ``build(ScheduleSpec(...))`` from plain values."""
    return build(
        ScheduleSpec(
            name=family(name).name,
            num_ranks=num_ranks,
            num_microbatches=num_microbatches,
            stages_per_rank=stages_per_rank,
            microbatch_group_size=microbatch_group_size,
        )
    )
