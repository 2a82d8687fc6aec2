"""ZB-V: zero bubble on a V placement, two chunks per rank (Qi et al. 2024, arXiv 2401.10241 §6).

Rank r holds chunk 0 = stage r (going down the V) and chunk 1 = stage 2p − 1 − r (coming back up),
so rank 0 holds both the first and the last stage and the turn at the bottom of the V is local. The
order per rank is the one torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` computes (its
``_calculate_single_rank_operations``), written here as numbered phases:

1. warm-up: 2(p − r) − 1 forwards of chunk 0;
2. r × (F chunk 1, F chunk 0);
3. (p − r) × (F, I, W) on chunk 1: the first backwards come up the V;
4. steady state while work remains: [F chunk 0 (if any left), I, W chunk 0], then [F, I, W chunk 1];
5. cool-down: r × (I chunk 0, I chunk 1); (p − r) × (I, W chunk 0); the remaining W of chunk 1,
   then of chunk 0.

At F = I = W the steady state has no bubble for m >= 2p − 1 and every rank holds at most 2p
chunk activations (p stages' worth, balanced across ranks).

Any m >= 1: the phases are laid out for ``max(m, 2p − 1)`` micro-batches (the fewest that fill the
V) and the actions of the micro-batches past m are left out, as torch does by padding with None.
No dependency crosses micro-batches, so deleting whole micro-batches from a valid program keeps
it valid (in the same per-rank order) and the phase counts need no other cap.
"""

from __future__ import annotations

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.builders.common import make_program, require_positive
from pipetrain.schedule.placement import v_shape
from pipetrain.schedule.program import Program

_KINDS = {"F": OpKind.F, "I": OpKind.I, "W": OpKind.W}


class _Row:
    """One rank's actions; per-(kind, chunk) micro-batch counters run in increasing order."""

    def __init__(self, stages: tuple[int, ...], num_microbatches: int) -> None:
        self.stages = stages
        self.num_microbatches = num_microbatches
        self.done = {(kind, chunk): 0 for kind in _KINDS for chunk in (0, 1)}
        self.actions: list[Action] = []

    def add(self, kind: str, chunk: int) -> None:
        microbatch = self.done[kind, chunk]
        self.done[kind, chunk] = microbatch + 1
        if microbatch < self.num_microbatches:  # padding micro-batch: leave it out
            self.actions.append(Action(_KINDS[kind], self.stages[chunk], microbatch))

    def count(self, kind: str, chunk: int) -> int:
        return self.done[kind, chunk]


def build_zbv(num_ranks: int, num_microbatches: int) -> Program:
    require_positive(num_ranks=num_ranks, num_microbatches=num_microbatches)
    p, m = num_ranks, num_microbatches
    placement = v_shape(p)
    rows = [_zbv_row(p, m, rank, placement.stages_of_rank(rank)) for rank in range(p)]
    return make_program("zbv", placement, m, rows)


def _zbv_row(p: int, m: int, rank: int, stages: tuple[int, ...]) -> list[Action]:
    num_laid_out = max(m, 2 * p - 1)  # micro-batches the phases are laid out for
    num_warmup = 2 * (p - rank) - 1
    num_interleaved = rank
    num_first_up = p - rank
    num_cool_pairs = rank
    num_cool_w0 = p - rank

    row = _Row(stages, m)
    for _ in range(num_warmup):  # phase 1
        row.add("F", 0)
    for _ in range(num_interleaved):  # phase 2
        row.add("F", 1)
        row.add("F", 0)
    for _ in range(num_first_up):  # phase 3
        for kind in "FIW":
            row.add(kind, 1)
    while row.count("F", 0) < num_laid_out or row.count("F", 1) < row.count("F", 0):  # phase 4
        if row.count("F", 0) < num_laid_out:
            row.add("F", 0)
        row.add("I", 0)
        row.add("W", 0)
        for kind in "FIW":
            row.add(kind, 1)
    for _ in range(num_cool_pairs):  # phase 5: cool-down
        row.add("I", 0)
        row.add("I", 1)
    for _ in range(num_cool_w0):
        row.add("I", 0)
        row.add("W", 0)
    for chunk in (1, 0):
        while row.count("W", chunk) < row.count("I", chunk):
            row.add("W", chunk)
    for kind in _KINDS:
        assert row.count(kind, 0) == row.count(kind, 1) == num_laid_out, (rank, row.done)
    return row.actions
