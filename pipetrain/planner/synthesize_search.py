"""The synthesis's judge and its local searches, the simulator deciding every step.

``judge`` prices a program with the planner's own model (``judge.simulate_plan``: the simulated
step and each rank's peak) after the checker has passed it (``validate(lower(...))``, the
blocking model torch's executor needs); ``improve_cut`` moves one layer between neighbouring
stages and builds the order again; ``improve_order`` swaps neighbouring actions of a rank's row
and pushes weight halves later (first improvement, within a budget of simulations), which is how
a family's program, or a greedy one, loses the waits its fixed rule or the greedy choice left in
it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.judge import Budget, simulate_plan, stage_costs
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.lower import lower
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.timeline import Timeline
from pipetrain.schedule.validate import validate
from pipetrain.sim.costs import Costs, StageCosts, rank_peak_memory
from pipetrain.sim.simulate import simulate

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


def _faster(
    current: Judged,
    rows: list[list[Action]],
    sim_costs: Costs,
    per_stage: StageCosts,
    budget: Budget,
) -> Judged | None:
    """``current`` with ``rows`` for its order, judged as ``judge`` would (no offload: the
    synthesis plans none) where its step is faster; its peaks are priced only then."""
    program = current.program.with_actions(rows)
    try:
        timeline = simulate(program, sim_costs)
    except ScheduleError:
        return None
    if not timeline.makespan < current.makespan * (1 - _TOLERANCE):
        return None
    peaks = rank_peak_memory(timeline, per_stage, program.placement.rank_of_stage)
    if max(peaks) > budget.usable:
        return None
    return replace(current, program=program, timeline=timeline, peaks=peaks)


def improve_order(costs: ModelCosts, best: Judged, budget: Budget, simulations: int) -> Judged:
    """Local search on the ranks' orders (``moves``), keeping the first move that is faster and
    fits, until no move helps or ``simulations`` run out; the result is checked
    (``validate(lower(...))``), else ``best`` comes back unchanged."""
    current, spent = best, 0
    program = best.program
    sim_costs = stage_costs(costs, program, best.cut, best.recompute)
    per_stage = sim_costs.per_stage(program.num_stages)
    while spent < simulations:
        found = None
        for rows in moves(current.program.actions):
            spent += 1
            found = _faster(current, rows, sim_costs, per_stage, budget)
            if found is not None or spent >= simulations:
                break
        if found is None:
            break
        current = found
    if current is best:
        return best
    checked = judge(costs, current.program, current.cut, current.recompute, budget, current.how)
    if checked is None or not checked.better_than(best):
        return best
    return replace(checked, how=f"{best.how}, then reordered by local search")


#: how far a weight half is pushed later in one move (the ZB rule: W fills the bubbles)
_DEFERRALS = (2, 4, 8)


def moves(rows: Sequence[Sequence[Action]]) -> Iterator[list[list[Action]]]:
    """The neighbours of a program's rows: a ``W`` pushed later by a few actions or to the end of
    its rank's row (into the cool-down's bubbles), and two neighbouring actions of other
    micro-batches swapped — never past an action of its own stage and kind, so each stage keeps
    running its micro-batches in order (the space ``synthesize_exact`` covers)."""
    for rank, row in enumerate(rows):
        for i, a in enumerate(row):
            if a.kind is not OpKind.W:
                continue
            targets = {min(i + k, len(row) - 1) for k in _DEFERRALS} | {len(row) - 1}
            for t in sorted(targets):
                passed = row[i + 1 : t + 1]
                if t > i and not any(b.kind is OpKind.W and b.stage == a.stage for b in passed):
                    moved = list(row)
                    moved.insert(t, moved.pop(i))
                    yield _replaced(rows, rank, moved)
    for rank, row in enumerate(rows):
        for i in range(len(row) - 1):
            a, b = row[i], row[i + 1]
            if a.microbatch != b.microbatch and (a.stage, a.kind) != (b.stage, b.kind):
                swapped = list(row)
                swapped[i], swapped[i + 1] = row[i + 1], row[i]
                yield _replaced(rows, rank, swapped)


def _replaced(rows: Sequence[Sequence[Action]], rank: int, row: list[Action]) -> list[list[Action]]:
    out = [list(r) for r in rows]
    out[rank] = row
    return out
