"""The planner's second pass, when no plan without recompute fits: the same shapes with stages
recomputing their activations (``planner.recompute`` states the model).

For each shape (family, stages per rank, micro-batches) already built:

* every stage ``"selective"``, then every stage ``"full"``: the cut searches of ``cuts.candidates``
  on the layers' costs under that mode (the time balance pays the recompute, the memory caps see
  the smaller activations);
* the cheapest mix: from the shape's fastest cut without recompute and from its lowest-peak cut,
  raise one stage at a time, choosing among the stages of the ranks still over budget the one
  whose next mode (none → selective → full; a step that frees nothing, as selective on a stage
  holding only the layer that feeds the loss, is passed over) frees the most activation per
  millisecond added; in that mode the stage recomputes the fewest of its first layers that
  bring its ranks within budget (found by bisection: memory falls as K grows), or all of them
  when none do, until every rank fits or nothing is left to raise. Recompute on a stage that
  is not the bottleneck costs the step little, and recompute of a few layers less than of all,
  which the uniform modes cannot express.

In an eager step (not ``captured``: a captured step cannot restore the random state a whole
stage's recompute needs), the best few of those plans are judged again with their recomputing
stages recomputed as a whole (``recompute.whole_stage``), one at a time and all together: the
same extra forward without per-layer checkpoint bookkeeping, which on a host-bound eager step is
the cheaper, and only the stage's input held, though its whole activation returns while its
backward runs.

The search then refines the fitting ones like any other (``cuts.refine``, keeping each stage's
mode) and picks the fastest per micro-batch, so a plan recomputes only where memory asks for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.cuts import candidates
from pipetrain.planner.judge import Budget, Candidate, evaluate, rank_key
from pipetrain.planner.partition import bounds
from pipetrain.planner.recompute import MODES, layers_under
from pipetrain.planner.recompute_modes import Recompute, StageRecompute, stage_recompute
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
        shape: list[Candidate] = []
        for mode in (Recompute.FULL, Recompute.SELECTIVE):
            shape += candidates(costs, program, name, v, budget, mode)
        mine = [
            c
            for c in plain
            if (c.plan.schedule, c.plan.stages_per_rank, c.plan.microbatches) == (name, v, m)
        ]
        if mine:
            shape += raised_from(costs, program, name, v, mine, budget)
        if not costs.captured:
            shape += as_whole(costs, program, name, v, shape, budget)
        out += shape
    return out


def raised_from(
    costs: ModelCosts,
    program: Program,
    name: str,
    v: int,
    mine: Sequence[Candidate],
    budget: Budget,
) -> list[Candidate]:
    """From the shape's fastest and its lowest-peak plain plans (``mine``): full recompute on
    every stage, and where that fits, one stage raised at a time (``raise_where_over``)."""
    out: list[Candidate] = []
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


#: how many of a shape's recomputing plans are judged with whole stages
AS_WHOLE = 4


def as_whole(
    costs: ModelCosts,
    program: Program,
    name: str,
    v: int,
    found: Sequence[Candidate],
    budget: Budget,
) -> list[Candidate]:
    """The ``AS_WHOLE`` best of ``found`` (fitting first, then the fastest), judged again with
    each of their recomputing stages (any mode, any K) recomputed as a whole instead, one at a
    time and all together: a stage checkpointing a few layers may fit as a whole stage too, at
    the plain forward's price."""
    seen: set[tuple[tuple[int, ...], tuple[str, ...]]] = set()
    out: list[Candidate] = []
    ranked = sorted(found, key=lambda c: (not c.plan.fits, rank_key(c)))
    for c in [c for c in ranked if any(m != Recompute.NONE for m in c.plan.recompute)][:AS_WHOLE]:
        modes = c.plan.recompute
        recomputing = [p for p, m in enumerate(modes) if m != Recompute.NONE]
        swaps = [(p,) for p in recomputing] + ([tuple(recomputing)] if len(recomputing) > 1 else [])
        for swap in swaps:
            whole = tuple(Recompute.WHOLE.value if p in swap else m for p, m in enumerate(modes))
            if (c.plan.stage_layers, whole) in seen:
                continue
            seen.add((c.plan.stage_layers, whole))
            out.append(
                evaluate(
                    costs, program, name, v, c.plan.stage_layers, "recompute-whole", budget, whole
                )
            )
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
    budget: the stage and mode that free the most activation per ms added, then the fewest of
    that stage's layers in that mode (its first K, ``StageRecompute``) that bring its ranks
    within budget, or all of them when none do; every step simulated and returned."""
    cut = start.plan.stage_layers
    blocks = bounds(cut)
    placement = program.placement
    ranks_of = [
        {placement.rank(s) for s in range(pos, program.num_stages, len(cut))}
        for pos in range(len(cut))
    ]
    specs = [stage_recompute(x) for x in start.plan.recompute]
    out: list[Candidate] = []
    current = start

    def judged(pos: int, spec: StageRecompute) -> Candidate:
        modes = [str(x) for x in specs]
        modes[pos] = str(spec)
        found = evaluate(costs, program, name, v, cut, "recompute-raised", budget, modes)
        out.append(found)
        return found

    def within(c: Candidate, pos: int) -> bool:
        return not any(c.plan.peak_gib[r] > budget.usable for r in ranks_of[pos])

    for _ in range(4 * len(cut)):  # each stage at most twice whole, twice in part
        if current.plan.fits:
            break
        over = {r for r, peak in enumerate(current.plan.peak_gib) if peak > budget.usable}
        options = [
            option
            for pos, (a, b) in enumerate(blocks)
            if ranks_of[pos] & over and any(x.params > 0 for x in costs.layers[a:b])
            for option in _raises(costs, pos, a, b, specs[pos])
        ]
        if not options:
            break
        *_, pos, mode = max(options)
        whole = judged(pos, StageRecompute(mode))
        lo, hi, best = 0, cut[pos], whole  # the fewest layers K in (lo, hi] whose ranks fit
        if within(whole, pos):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                found = judged(pos, StageRecompute(mode, mid))
                if within(found, pos) and _frees_more(costs, blocks[pos], mid, mode, specs[pos]):
                    hi, best = mid, found
                else:
                    lo = mid
        specs[pos] = stage_recompute(best.plan.recompute[pos])
        current = best
    return out


def _raises(
    costs: ModelCosts, pos: int, a: int, b: int, now: StageRecompute
) -> list[tuple[float, int, int, Recompute]]:
    """The next mode above ``now`` on the whole stage ``pos`` (layers ``a:b``) that frees some
    activation, as (GiB freed per ms added, -pos, pos, mode); none where it recomputes fully."""
    if now == StageRecompute(Recompute.FULL) or now.mode is Recompute.WHOLE:
        return []
    n = costs.num_layers
    current = layers_under(costs.layers[a:b], now, a, n, costs.captured)
    held = sum(x.activation for x in current)
    paid = sum(x.backward + x.forward for x in current)
    for higher in MODES[MODES.index(now.mode) :]:
        if higher is Recompute.NONE or StageRecompute(higher) == now:
            continue
        then = layers_under(costs.layers[a:b], higher, a, n, costs.captured)
        freed = held - sum(x.activation for x in then)
        if freed > 0:
            added = sum(x.backward + x.forward for x in then) - paid
            return [(freed / added if added > 0 else float("inf"), -pos, pos, higher)]
    return []


def _frees_more(
    costs: ModelCosts, block: tuple[int, int], k: int, mode: Recompute, now: StageRecompute
) -> bool:
    """Whether ``mode`` on the first ``k`` layers of the stage over ``block`` holds less than
    ``now`` does (a raise never holds more than the step before it)."""
    a, b = block
    n = costs.num_layers

    def held(spec: StageRecompute) -> float:
        return sum(
            x.activation for x in layers_under(costs.layers[a:b], spec, a, n, costs.captured)
        )

    return held(StageRecompute(mode, k)) < held(now)
