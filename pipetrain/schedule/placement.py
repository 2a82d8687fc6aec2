"""Placements: which rank holds which stage.

Stage ``s`` feeds stage ``s + 1``; the placement only says where each stage lives. The three
published layouts are one stage per rank (GPipe, 1F1B, ZB-H1/H2), looped (Megatron's interleaved
1F1B, looped BFS: stage = chunk·ranks + rank) and V (ZBV, DualPipeV: rank r holds stages r and
2·ranks − 1 − r, so the first and last stage share rank 0 and the turn at the bottom of the V costs
no communication). Any explicit map works too.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class PlacementKind(StrEnum):
    ONE_PER_RANK = "one-per-rank"
    LOOPED = "looped"
    V = "v"
    BIDIRECTIONAL = "bidirectional"
    EXPLICIT = "explicit"


@dataclass(frozen=True, slots=True)
class Placement:
    """``rank_of_stage[s]`` is the rank that runs stage ``s``."""

    rank_of_stage: tuple[int, ...]
    num_ranks: int
    kind: PlacementKind = PlacementKind.EXPLICIT
    #: stages per chain (a copy of the model); ``None``: one chain of every stage
    chain_length: int | None = None

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ValueError(f"a placement needs at least one rank, got num_ranks={self.num_ranks}")
        if not self.rank_of_stage:
            raise ValueError("a placement needs at least one stage")
        bad = [r for r in self.rank_of_stage if not 0 <= r < self.num_ranks]
        if bad:
            raise ValueError(
                f"stage ranks {bad} out of range: legal ranks are 0..{self.num_ranks - 1}"
            )
        idle = sorted(set(range(self.num_ranks)) - set(self.rank_of_stage))
        if idle:
            raise ValueError(f"ranks {idle} hold no stage: every rank needs at least one")
        if self.chain_length is not None and (
            self.chain_length < 1 or len(self.rank_of_stage) % self.chain_length
        ):
            raise ValueError(
                f"chain_length {self.chain_length} must divide the {len(self.rank_of_stage)} stages"
            )

    @property
    def stages_per_chain(self) -> int:
        """How many stages one micro-batch flows through."""
        return self.chain_length or len(self.rank_of_stage)

    @property
    def num_chains(self) -> int:
        return len(self.rank_of_stage) // self.stages_per_chain

    def chain(self, stage: int) -> int:
        return stage // self.stages_per_chain

    @property
    def num_stages(self) -> int:
        return len(self.rank_of_stage)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.rank_of_stage) if r == rank)

    @property
    def stages_per_rank(self) -> int | None:
        """The common number of stages per rank, or ``None`` if ranks hold different counts."""
        counts = {self.rank_of_stage.count(r) for r in range(self.num_ranks)}
        return counts.pop() if len(counts) == 1 else None

    def rank(self, stage: int) -> int:
        return self.rank_of_stage[stage]


def one_per_rank(num_ranks: int) -> Placement:
    return Placement(tuple(range(num_ranks)), num_ranks, PlacementKind.ONE_PER_RANK)


def looped(num_ranks: int, stages_per_rank: int) -> Placement:
    """Stage ``chunk·ranks + rank`` on ``rank`` (Narayanan et al. 2021, Fig. 4)."""
    stages = tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))
    kind = PlacementKind.ONE_PER_RANK if stages_per_rank == 1 else PlacementKind.LOOPED
    return Placement(stages, num_ranks, kind)


def v_shape(num_ranks: int) -> Placement:
    """Rank ``r`` holds stages ``r`` and ``2·ranks − 1 − r`` (ZB paper §6, DualPipeV)."""
    down = list(range(num_ranks))
    return Placement(tuple(down + down[::-1]), num_ranks, PlacementKind.V)


def bidirectional(num_ranks: int) -> Placement:
    """DualPipe's two chains: stage k of the down chain on rank k, stage k of the up chain
    (stage ``ranks + k``) on rank ``ranks − 1 − k``."""
    down = list(range(num_ranks))
    return Placement(tuple(down + down[::-1]), num_ranks, PlacementKind.BIDIRECTIONAL, num_ranks)


def infer_kind(
    rank_of_stage: tuple[int, ...], num_ranks: int, chain_length: int | None = None
) -> PlacementKind:
    """Name a map that matches one of the published layouts (for programs loaded from files)."""
    num_stages = len(rank_of_stage)
    if chain_length and chain_length != num_stages:
        if rank_of_stage == bidirectional(num_ranks).rank_of_stage:
            return PlacementKind.BIDIRECTIONAL
        return PlacementKind.EXPLICIT
    if num_stages % num_ranks == 0:
        v = num_stages // num_ranks
        if rank_of_stage == looped(num_ranks, v).rank_of_stage:
            return PlacementKind.ONE_PER_RANK if v == 1 else PlacementKind.LOOPED
        if v == 2 and rank_of_stage == v_shape(num_ranks).rank_of_stage:
            return PlacementKind.V
    return PlacementKind.EXPLICIT
