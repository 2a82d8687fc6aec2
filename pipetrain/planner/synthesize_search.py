"""The synthesis's judge and its local searches, the simulator deciding every step.

``judge`` prices a program with the planner's own model (``judge.simulate_plan``: the simulated
step and each rank's peak) after the checker has passed it (``validate(lower(...))``, the
blocking model torch's executor needs); ``improve_cut`` moves one layer between neighbouring
stages and builds the order again; ``improve_order`` swaps neighbouring actions of a rank's row
(first improvement, within a budget of simulations), which is how a family's program, or a greedy
one, loses the waits its fixed rule or the greedy choice left in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.judge import Budget, simulate_plan
from pipetrain.schedule.lower import lower
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.timeline import Timeline
from pipetrain.schedule.validate import validate

__all__ = ["Judged", "improve_cut", "improve_order", "judge"]

#: a program counts as faster only by more than this share (the simulator's float sums)
_TOLERANCE = 1e-9


@dataclass(frozen=True)
class Judged:
    """A program with its cut and recompute, its simulated step and per-rank peak (GiB)."""

    program: Program
    cut: tuple[int, ...]
    recompute: tuple[str, ...]
    timeline: Timeline
    peaks: tuple[float, ...]
    fits: bool
    how: str

    @property
    def makespan(self) -> float:
        return self.timeline.makespan

    def better_than(self, other: Judged) -> bool:
        """Fits, and is faster than ``other`` by more than float noise."""
        return self.fits and self.makespan < other.makespan * (1 - _TOLERANCE)


def judge(
    costs: ModelCosts,
    program: Program,
    cut: Sequence[int],
    recompute: Sequence[str],
    budget: Budget,
    how: str,
    *,
    check: bool = True,
) -> Judged | None:
    """``program`` cut by ``cut`` simulated and its peaks priced; ``None`` when the checker
    refuses it (``check=False`` leaves the checker to the caller; the simulator still refuses a
    deadlock)."""
    try:
        if check:
            validate(lower(program))
        timeline, peaks = simulate_plan(costs, program, tuple(cut), tuple(recompute))
    except ScheduleError:
        return None
    fits = max(peaks) <= budget.usable
    return Judged(program, tuple(cut), tuple(recompute), timeline, peaks, fits, how)


def improve_cut(
    best: Judged, rebuild: Callable[[tuple[int, ...]], Judged | None], rounds: int = 12
) -> Judged:
    """Move one layer between neighbouring stages of ``best``'s cut, build the order again
    (``rebuild``), keep the first faster fitting one; repeat while it helps, at most ``rounds``
    times. Cuts of stages that recompute only some of their layers are left as they are."""
    if any(":" in mode for mode in best.recompute):
        return best
    for _ in range(rounds):
        improved = None
        for cut in _neighbour_cuts(best.cut):
            judged = rebuild(cut)
            if judged is not None and judged.better_than(best):
                improved = replace(judged, how=f"{judged.how}, layers moved")
                break
        if improved is None:
            return best
        best = improved
    return best


def _neighbour_cuts(cut: tuple[int, ...]) -> list[tuple[int, ...]]:
    out = []
    for s in range(len(cut) - 1):
        for give, take in ((s, s + 1), (s + 1, s)):
            if cut[give] > 1:
                moved = list(cut)
                moved[give] -= 1
                moved[take] += 1
                out.append(tuple(moved))
    return out


def improve_order(costs: ModelCosts, best: Judged, budget: Budget, simulations: int) -> Judged:
    """Swap neighbouring actions of other micro-batches on one rank, keeping the first swap that
    is faster and fits, until no swap helps or ``simulations`` run out; the result is checked
    (``validate(lower(...))``), else ``best`` comes back unchanged."""
    current, spent, improved = best, 0, False
    while spent < simulations:
        found = None
        rows = [list(r) for r in current.program.actions]
        for rank, row in enumerate(rows):
            for i in range(len(row) - 1):
                if row[i].microbatch == row[i + 1].microbatch or spent >= simulations:
                    continue
                swapped = [list(r) for r in rows]
                swapped[rank][i], swapped[rank][i + 1] = row[i + 1], row[i]
                spent += 1
                judged = judge(
                    costs,
                    current.program.with_actions(swapped),
                    current.cut,
                    current.recompute,
                    budget,
                    current.how,
                    check=False,
                )
                if judged is not None and judged.better_than(current):
                    found = judged
                    break
            if found is not None:
                break
        if found is None:
            break
        current, improved = found, True
    if not improved:
        return best
    checked = judge(
        costs, current.program, current.cut, current.recompute, budget, current.how
    )
    if checked is None or not checked.better_than(best):
        return best
    return replace(checked, how=f"{best.how}, then neighbouring actions swapped")
