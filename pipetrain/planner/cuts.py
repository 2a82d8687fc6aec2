"""Which cuts the planner simulates for one schedule shape (family, stages per rank ``v``,
micro-batches ``M``), and the refinement of the best ones.

Why these are enough (docs/planning.md states it in full): the step of every schedule is at
least ``M`` times the busiest stage's forward + backward, and the steady state of the registry's
families runs at that pace, so the cuts that minimise the busiest stage (``partition.min_max_cut``,
exact; filled from the front, from the back, and evenly) are the ones to beat; with several
stages per rank a rank-balanced cut joins them, the uniform cut always does, and when the fastest
does not fit, the same exact search runs under per-stage memory caps derived from the simulated
in-flight counts. The simulation judges them all (``judge``); ``refine`` then moves layers
between the stages of the best cuts of the fastest shapes, one or two at a time. With every stage
recomputing one way (``mode``), the same searches run on the layers' costs under that mode, so
the time balance counts the recompute and the memory caps the smaller activations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.judge import Budget, Candidate, evaluate, rank_key, step_bound
from pipetrain.planner.partition import (
    Limit,
    bounds,
    even_min_max_cut,
    min_max_cut,
    rank_balanced_cut,
    uniform_cut,
)
from pipetrain.planner.recompute import recomputed_costs, uniform
from pipetrain.planner.recompute_modes import Recompute
from pipetrain.schedule.program import Program
from pipetrain.schedule.timeline import Timeline
from pipetrain.sim.bound import count_actions

#: the fitting shapes (family, stages per rank, micro-batches) whose best cut is refined
REFINE_SHAPES = 3
#: compute actions the refinement may simulate in all (a few microseconds each)
REFINE_ACTIONS = 1_000_000
#: rounds of tightening the per-stage memory caps towards the budget
_MEMORY_ROUNDS = 3
#: relative slack on a lower bound before it prunes: the bound and the simulator add the same
#: costs in different orders, so two equal steps may differ in their last bits
_MARGIN = 1e-9


def candidates(
    costs: ModelCosts,
    program: Program,
    name: str,
    v: int,
    budget: Budget,
    mode: Recompute = Recompute.NONE,
) -> list[Candidate]:
    """The cuts worth simulating for one shape (module docstring), each simulated, every stage
    recomputing as ``mode`` says."""
    chain = program.placement.stages_per_chain
    modes = uniform(mode, chain) if mode is not Recompute.NONE else ()
    view = recomputed_costs(costs, mode)
    time = [layer.forward + layer.backward for layer in view.layers]
    cuts: dict[tuple[int, ...], str] = {}
    for cut, how in (
        (min_max_cut(time, chain), "balanced"),
        (min_max_cut(time, chain, from_the_back=True), "balanced-back"),
        (even_min_max_cut(time, chain), "balanced-even"),
        (uniform_cut(costs.num_layers, chain), "uniform"),
    ):
        if cut is not None:
            cuts.setdefault(cut, how)
    if program.num_stages > program.num_ranks:  # several stages per rank: balance the ranks
        even = even_min_max_cut(time, chain) or uniform_cut(costs.num_layers, chain)
        cuts.setdefault(
            rank_balanced_cut(time, even, program.placement.rank_of_stage), "rank-balanced"
        )
    done = [evaluate(costs, program, name, v, cut, how, budget, modes) for cut, how in cuts.items()]
    if min(done, key=rank_key).plan.fits:
        return done
    # The fastest cut does not fit: balance time under a per-stage memory cap, the cap of each stage its rank's
    # budget shared among its stages and divided by the simulated in-flight count, tightened
    # where the simulated peak still overshoots.
    scale = [1.0] * program.num_ranks
    reference = min(done, key=lambda c: max(c.plan.peak_gib))
    for _ in range(_MEMORY_ROUNDS):
        inflight = _inflight(reference.timeline, program)
        tried = []
        limit = _memory_limit(view, program, inflight, budget.usable, scale)
        for cut, how in (
            (min_max_cut(time, chain, limit), "memory"),
            (min_max_cut(time, chain, limit, from_the_back=True), "memory-back"),
            (even_min_max_cut(time, chain, limit), "memory-even"),
        ):
            if cut is not None and cut not in cuts:
                cuts[cut] = how
                tried.append(evaluate(costs, program, name, v, cut, how, budget, modes))
        done += tried
        if not tried or any(c.plan.fits for c in tried):
            break
        reference = min(tried, key=lambda c: max(c.plan.peak_gib))
        for r, peak in enumerate(reference.plan.peak_gib):
            if peak > budget.usable:
                scale[r] *= budget.usable / peak
    return done


def refine(
    found: Sequence[Candidate],
    costs: ModelCosts,
    programs: Mapping[tuple[str, int, int], Program],
    budget: Budget,
    prune: bool = True,
) -> list[Candidate]:
    """Hill-climb the cuts of the fastest fitting shapes with the simulation as the judge: from
    each distinct fitting cut of a shape (fastest first), move one boundary by one layer (from
    the heavier of its two stages first), hand a layer between distant stages, or make two such
    moves (``_neighbours``), keep the first move that is faster and fits, repeat until none is
    or the budget of simulated actions is spent. What the min-max objective cannot see (fill and
    drain, comm, W filling bubbles, several stages per rank) the simulation can. Climbing from every starting cut, not only the best, matters with several
    stages per rank, where a rank's load is a sum over distant stages and one climb can stop in
    a local minimum (interleaved 1F1B on small random models, climbing from the best start alone:
    measured in docs/performance.md). A shape here includes what its stages recompute, which
    the moves keep, and what they offload. Returns every cut it simulated.

    With ``prune``, a move whose step cannot beat the current best (``judge.step_bound``, a
    lower bound from the costs alone) is not simulated, but it is counted against the budget and
    as seen as if it were: such a move is never kept (keeping needs a step no longer than the
    best's), so the climb takes the same moves, stops at the same cut and returns the same
    best, only without the candidates it proved slower."""
    out: list[Candidate] = []
    shapes: dict[tuple[str, int, int, tuple[str, ...], tuple[float, ...]], list[Candidate]] = {}
    for c in sorted((c for c in found if c.plan.fits), key=rank_key):
        plan = c.plan
        key = (plan.schedule, plan.stages_per_rank, plan.microbatches, plan.recompute, plan.offload)
        if key in shapes or len(shapes) < REFINE_SHAPES:
            shapes.setdefault(key, []).append(c)
    actions_left = REFINE_ACTIONS
    time = [layer.forward + layer.backward for layer in costs.layers]
    for (name, v, m, modes, offload), starts in shapes.items():
        program = programs[name, v, m]
        size = sum(len(row) for row in program.actions)
        counts = count_actions(program) if prune else None
        seen = {c.plan.stage_layers for c in starts}
        for best in starts:
            improved = True
            while improved:
                improved = False
                for cut in _neighbours(best.plan.stage_layers, time):
                    if cut in seen:
                        continue
                    if actions_left < size:
                        return out
                    actions_left -= size
                    seen.add(cut)
                    if counts is not None:
                        bound = step_bound(costs, counts, cut, modes)
                        if bound is not None and bound > best.plan.step_ms * (1 + _MARGIN):
                            continue  # slower than the best, whatever the simulation says
                    c = evaluate(costs, program, name, v, cut, "refined", budget, modes, offload)
                    out.append(c)
                    if c.plan.fits and rank_key(c) < rank_key(best):
                        best, improved = c, True
                        break
    return out


#: longest chain of stages whose two-move neighbourhood the refinement searches
PAIR_MOVES_UP_TO = 32
#: longest chain whose two-move neighbourhood includes handovers between distant stages (it
#: grows with the fourth power of the chain)
FAR_PAIRS_UP_TO = 8


def _neighbours(cut: tuple[int, ...], time: Sequence[float]) -> Iterator[tuple[int, ...]]:
    """One-layer moves between neighbouring stages first; then, for chains up to
    ``PAIR_MOVES_UP_TO`` stages, one layer handed between two distant stages (every stage
    between them shifting by a layer: with several stages per rank the first and the last stage
    of a V share a rank, and such a move keeps the rank loads and changes only fill and drain),
    and two neighbouring moves (a rank's load is split over distant stages, so the better cut is
    often two moves away through a worse one); up to ``FAR_PAIRS_UP_TO`` stages, also two moves
    of which one or both are handovers. On small random models this finds the exhaustive best
    cut every time (benchmarks/planner/plan_optimality.py, docs/planning.md)."""
    singles = _moves(cut, time)
    yield from singles
    if len(cut) > PAIR_MOVES_UP_TO:
        return
    far = _handovers(cut)
    yield from far
    for first in singles:
        yield from _moves(first, time)
    if len(cut) <= FAR_PAIRS_UP_TO:
        for first in singles + far:
            yield from _handovers(first)
        for first in far:
            yield from _moves(first, time)


def _handovers(cut: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Cuts where stage ``give`` hands one layer to a stage at least two positions away."""
    return [
        _hand(cut, give, take)
        for give in range(len(cut))
        if cut[give] > 1
        for take in range(len(cut))
        if abs(take - give) > 1
    ]


def _hand(cut: tuple[int, ...], give: int, take: int) -> tuple[int, ...]:
    """``cut`` with one layer handed from stage ``give`` to stage ``take``."""
    moved = list(cut)
    moved[give] -= 1
    moved[take] += 1
    return tuple(moved)


def _moves(cut: tuple[int, ...], time: Sequence[float]) -> list[tuple[int, ...]]:
    """Cuts one layer away from ``cut`` (every stage keeping one), the heavier side giving first."""
    load = [sum(time[a:b]) for a, b in bounds(cut)]
    scored = []
    for i in range(len(cut) - 1):
        for give, take in ((i, i + 1), (i + 1, i)):
            if cut[give] > 1:
                scored.append((load[take] - load[give], _hand(cut, give, take)))
    return [c for _, c in sorted(scored)]


def _inflight(timeline: Timeline, program: Program) -> list[float]:
    """Per stage: how many micro-batches its rank holds at its peak, shared among the rank's
    stages (the simulated count under unit activation sizes)."""
    ones = dataclasses.replace(
        timeline,
        activation_size=(1.0,) * program.num_stages,
        weight_activation_size=None,
        workspace_size=None,
    )
    placement = program.placement
    return [
        ones.peak_activations[placement.rank(s)] / len(placement.stages_of_rank(placement.rank(s)))
        for s in range(program.num_stages)
    ]


def _memory_limit(
    costs: ModelCosts,
    program: Program,
    inflight: Sequence[float],
    memory_gib: float,
    scale: Sequence[float],
) -> Limit:
    """``limit(stage, first, end)`` for ``min_max_cut``: the stage's static memory plus its
    in-flight activations within its share of its rank's budget."""
    placement = program.placement
    chain = placement.stages_per_chain
    params = [0.0]
    act = [0.0]
    for layer in costs.layers:
        params.append(params[-1] + layer.params)
        act.append(act[-1] + layer.activation)
    # a chain position stands for every stage holding that block (DualPipe's two copies)
    caps: list[float] = []
    counts: list[float] = []
    for pos in range(chain):
        stages = range(pos, program.num_stages, chain)
        caps.append(
            min(
                memory_gib
                * scale[placement.rank(s)]
                / len(placement.stages_of_rank(placement.rank(s)))
                for s in stages
            )
        )
        counts.append(max(inflight[s] for s in stages))

    def limit(stage: int, first: int, end: int) -> bool:
        held = params[end] - params[first] + counts[stage] * (act[end] - act[first])
        return held <= caps[stage]

    return limit
