"""The exact optimum on tiny cases: every order of every rank tried, so the synthesis's heuristic
can say how far from optimal it is where the optimum is known (docs/synthesis.md).

A rank's order is any interleaving of its stages' forwards, input halves and weight halves (or
whole backwards) in which each stage runs its micro-batches in order within each kind and a
micro-batch's ``F`` comes before its ``I`` and its ``I`` before its ``W`` — the space the greedy
rule (``synthesize_order``) chooses in. Every combination of the ranks' orders is simulated and
priced under the memory cap (``synthesize_search.judge``); a combination that deadlocks is
skipped. The count grows as a product of multinomials: this is for two or three ranks and two or
three micro-batches, which is where it is used (tests, and the gap table of the docs).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.judge import Budget
from pipetrain.planner.synthesize_search import Judged, judge
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.placement import Placement
from pipetrain.schedule.program import Program

__all__ = ["MAX_PROGRAMS", "exact_best", "rank_orders"]

#: the most programs ``exact_best`` simulates before refusing the case as too large
MAX_PROGRAMS = 200_000


def rank_orders(stages: Sequence[int], num_microbatches: int, split: bool) -> list[list[Action]]:
    """Every order of one rank's actions in the space of the module docstring."""
    kinds = (OpKind.F, OpKind.I, OpKind.W) if split else (OpKind.F, OpKind.B)
    out: list[list[Action]] = []

    def extend(done: dict[tuple[OpKind, int], int], row: list[Action]) -> None:
        if len(row) == len(stages) * len(kinds) * num_microbatches:
            out.append(list(row))
            return
        for s in stages:
            for n, kind in enumerate(kinds):
                j = done[kind, s]
                before = done[kinds[n - 1], s] if n else num_microbatches
                if j < num_microbatches and j < before:
                    done[kind, s] += 1
                    row.append(Action(kind, s, j))
                    extend(done, row)
                    row.pop()
                    done[kind, s] -= 1

    extend({(k, s): 0 for k in kinds for s in stages}, [])
    return out


def exact_best(
    costs: ModelCosts,
    placement: Placement,
    num_microbatches: int,
    cut: Sequence[int],
    recompute: Sequence[str],
    budget: Budget,
) -> Judged | None:
    """The fastest program that fits, over every combination of the ranks' orders (``None``:
    none fits); ``ValueError`` when there are more than ``MAX_PROGRAMS`` combinations."""
    per_rank = [
        rank_orders(placement.stages_of_rank(r), num_microbatches, costs.split_backward)
        for r in range(placement.num_ranks)
    ]
    total = 1
    for orders in per_rank:
        total *= len(orders)
    if total > MAX_PROGRAMS:
        raise ValueError(
            f"{total} programs to try, over the {MAX_PROGRAMS} an exact search runs; use fewer "
            "ranks, stages or micro-batches"
        )
    best: Judged | None = None
    for rows in _combinations(per_rank):
        program = Program(placement, num_microbatches, rows, "exact")
        judged = judge(costs, program, cut, recompute, budget, "exact", check=False)
        if judged is not None and judged.fits and (best is None or judged.better_than(best)):
            best = judged
    return best


def _combinations(per_rank: list[list[list[Action]]]) -> Iterator[tuple[tuple[Action, ...], ...]]:
    for rows in itertools.product(*per_rank):
        yield tuple(tuple(r) for r in rows)
