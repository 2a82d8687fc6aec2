"""The planner's second pass, when no plan without recompute fits: the same shapes with stages
recomputing their activations (``planner.recompute`` states the model).

For each shape (family, stages per rank, micro-batches) already built:

* every stage ``"selective"``, then every stage ``"full"``: the cut searches of ``cuts.candidates``
  on the layers' costs under that mode (the time balance pays the recompute, the memory caps see
  the smaller activations);
* the cheapest mix: from the shape's fastest cut without recompute and from its lowest-peak cut,
  raise one stage a step (none → selective → full; a step that frees nothing, as selective on a
  stage holding only the layer that feeds the loss, is passed over) at a time, choosing among
  the stages of the ranks still over budget the one that frees the most activation per
  millisecond of recompute added, until every rank fits or nothing is left to raise. Recompute
  on a stage that is not the bottleneck costs the step little, which the uniform modes cannot
  express.

The search then refines the fitting ones like any other (``cuts.refine``, keeping each stage's
mode) and picks the fastest per micro-batch, so a plan recomputes only where memory asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.cuts import candidates
from pipetrain.planner.judge import Budget, Candidate, evaluate, rank_key
from pipetrain.planner.partition import bounds
from pipetrain.planner.recompute import MODES, Recompute, layers_under
from pipetrain.schedule.program import Program


def recompute_candidates(
    costs: ModelCosts,
    programs: Mapping[tuple[str, int, int], Program],
    plain: Sequence[Candidate],
    budget: Budget,
) -> list[Candidate]:
    """Every shape of ``programs`` judged with recompute (module docstring); ``plain``: the
    candidates without recompute already simulated."""
    out: list[Candidate] = []
    if static_floor(costs, next(iter(programs.values())).num_ranks) > budget.usable:
        return out
    for (name, v, m), program in programs.items():
        for mode in (Recompute.FULL, Recompute.SELECTIVE):
            out += candidates(costs, program, name, v, budget, mode)
        mine = [
            c
            for c in plain
            if (c.plan.schedule, c.plan.stages_per_rank, c.plan.microbatches) == (name, v, m)
        ]
        if not mine:
            continue
        fastest, lowest = min(mine, key=rank_key), min(mine, key=lambda c: max(c.plan.peak_gib))
        for start in (fastest, lowest) if lowest is not fastest else (fastest,):
            # raising ends at full recompute on every stage at best: try that first
            cut = start.plan.stage_layers
            full = (Recompute.FULL,) * len(cut)
            ceiling = evaluate(costs, program, name, v, cut, "full", budget, full)
            out.append(ceiling)
            if ceiling.plan.fits:
                out += raise_where_over(costs, program, name, v, start, budget)
    return out


def static_floor(costs: ModelCosts, num_ranks: int) -> float:
    """A lower bound on the largest rank's static memory under any cut: recompute does not lower
    it, so when it exceeds the budget no recompute is worth simulating."""
    heaviest = max(layer.params for layer in costs.layers)
    return max(heaviest, sum(layer.params for layer in costs.layers) / num_ranks)


def raise_where_over(
    costs: ModelCosts, program: Program, name: str, v: int, start: Candidate, budget: Budget
) -> list[Candidate]:
    """From ``start``'s cut, raise the recompute of one stage at a time where a rank is over
    budget, the most activation freed per ms added first; every step simulated and returned."""
    cut = start.plan.stage_layers
    blocks = bounds(cut)
    placement = program.placement
    ranks_of = [
        {placement.rank(s) for s in range(pos, program.num_stages, len(cut))}
        for pos in range(len(cut))
    ]
    modes = [Recompute(x) for x in start.plan.recompute]
    out: list[Candidate] = []
    current = start
    while not current.plan.fits:
        over = {r for r, peak in enumerate(current.plan.peak_gib) if peak > budget.usable}
        options = []
        for pos, (a, b) in enumerate(blocks):
            if modes[pos] is Recompute.FULL or not ranks_of[pos] & over:
                continue
            if not any(x.params > 0 for x in costs.layers[a:b]):  # refused by the runtime
                continue
            n = costs.num_layers
            now = layers_under(costs.layers[a:b], modes[pos], a, n)
            for higher in MODES[MODES.index(modes[pos]) + 1 :]:  # the next mode that frees some
                then = layers_under(costs.layers[a:b], higher, a, n)
                freed = sum(x.activation for x in now) - sum(x.activation for x in then)
                if freed > 0:
                    added = sum(x.backward for x in then) - sum(x.backward for x in now)
                    options.append(
                        (freed / added if added > 0 else float("inf"), -pos, pos, higher)
                    )
                    break
        if not options:
            break
        *_, pos, higher = max(options)
        modes[pos] = higher
        current = evaluate(costs, program, name, v, cut, "recompute-raised", budget, modes)
        out.append(current)
    return out
