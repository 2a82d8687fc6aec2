"""Synthesized schedules: a program built for one model's measured per-stage costs instead of
picked among the families, under the same memory cap, never slower than the planner's pick.

The families are written for equal stages; a heavy LM head, a tied 256k embedding or layers that
do not divide by the ranks leave each family's fixed warm-up depths and interleavings waiting on
the slowest stage. The ZB paper built its own schedules this way (Qi et al., *Zero Bubble
Pipeline Parallelism*, ICLR 2024, §3: F, B, W ordered greedily from measured times under a
memory limit); FlexPipe (2025) searches schedules rather than picking one. Here:

1. the planner searches as it always does (``search``) at the asked micro-batch count, with no
   offload; its pick is the baseline and its program the first candidate;
2. for the fastest fitting cuts with one stage per rank and with the V placement (ZBV's and
   DualPipeV's: rank ``r`` holds stages ``r`` and ``2p − 1 − r``), each with the recompute the
   planner chose, the greedy rule (``synthesize_order``) builds programs under several variants
   — caps on micro-batches in flight per rank, when ``W`` fills, which chunk's forward comes
   first — each rank's activation cap being its budget less its static memory and workspace, and
   tightened where the judged peak overshoots;
3. the best of them moves one layer between neighbouring stages and is built again, while that
   is faster and fits (``synthesize_search``);
4. the best program so far, synthesized or the family's, is improved by swapping neighbouring
   actions on a rank (``synthesize_search.improve_order``).

Every judgement is the planner's own (``judge.simulate_plan``: the simulator's time and
``rank_peak_memory``), so a synthesized program is compared with the families on one model; and
every program returned has passed ``validate(lower(...))``. Pure standard library.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.judge import DEFAULT_HEADROOM, Budget, Candidate, Plan, stage_costs
from pipetrain.planner.search import Search, as_costs, search
from pipetrain.planner.synthesize_order import OrderPolicy, StageTimes, greedy_program
from pipetrain.planner.synthesize_search import Judged, improve_cut, improve_order, judge
from pipetrain.schedule.placement import Placement, PlacementKind, one_per_rank, v_shape
from pipetrain.schedule.program import Program
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.timeline import Timeline
from pipetrain.sim.costs import per_rank

__all__ = [
    "Synthesis",
    "synthesize",
    "synthesize_from_search",
    "synthesize_orders",
    "synthesize_plan",
]

#: cuts tried per placement: the fastest fitting distinct ones of the planner's search
STARTS_PER_PLACEMENT = 3
#: simulations the order's local search may spend on each finalist
ORDER_BUDGET = 400
#: the fastest greedy programs whose cut and order are improved further (besides the planner's)
FINALISTS = 3


@dataclass(frozen=True)
class Synthesis:
    """A synthesized program and its cut, judged, beside the planner's pick it started from."""

    program: Program
    #: layers per stage, in stage order (as ``Layout.stage_layers``)
    stage_layers: tuple[int, ...]
    recompute: tuple[str, ...]
    timeline: Timeline
    peak_gib: tuple[float, ...]
    baseline: Plan
    baseline_timeline: Timeline
    #: how the program was found: the start and the steps that improved it
    how: str
    #: per rank, its stages' static memory (GiB): what its activations stand on
    static_gib: tuple[float, ...] = ()

    @property
    def step_ms(self) -> float:
        return self.timeline.makespan

    @property
    def ms_per_microbatch(self) -> float:
        return self.step_ms / self.program.num_microbatches

    @property
    def speedup(self) -> float:
        """The planner's pick's time per micro-batch over this one's (its step over this step
        where both run as many micro-batches)."""
        return self.baseline.ms_per_microbatch / self.ms_per_microbatch

    def to_json(self) -> dict[str, object]:
        return {
            "ranks": self.program.num_ranks,
            "microbatches": self.program.num_microbatches,
            "stage_layers": list(self.stage_layers),
            "recompute": list(self.recompute),
            "how": self.how,
            "predicted": {
                "step_ms": self.step_ms,
                "bubble_fraction": self.timeline.bubble_fraction,
                "peak_gib": list(self.peak_gib),
            },
            "baseline": self.baseline.to_json(),
        }


def synthesize(
    costs: ModelCosts | Mapping[str, object] | str | os.PathLike[str],
    *,
    num_ranks: int,
    num_microbatches: int,
    memory_gib: float,
    headroom: float = DEFAULT_HEADROOM,
    order_budget: int = ORDER_BUDGET,
) -> Synthesis:
    """A program for ``costs`` on ``num_ranks`` ranks and ``num_microbatches`` micro-batches
    whose every rank's predicted peak fits ``memory_gib`` less ``headroom``, at least as fast in
    simulation as ``pipetrain.plan``'s pick at that micro-batch count (module docstring).
    ``ValueError`` names bad input; ``NoPlanFits`` when not even the planner fits."""
    model = as_costs(costs)
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")
    found = search(
        model,
        num_ranks=num_ranks,
        memory_gib=memory_gib,
        microbatches=[num_microbatches],
        headroom=headroom,
        offload=False,
    )
    return synthesize_from_search(model, found, order_budget=order_budget)


def synthesize_from_search(
    costs: ModelCosts, found: Search, *, order_budget: int = ORDER_BUDGET
) -> Synthesis:
    """``synthesize`` on a search already run (the planner's hook: ``found`` at one micro-batch
    count); its best fitting candidate that offloads nothing is the baseline (the synthesis
    plans no offload; ``NoPlanFits`` when only offloading candidates fit)."""
    found = replace(found, candidates=[c for c in found.candidates if not c.plan.layout.offloads])
    base = found.best
    counts = {c.plan.microbatches for c in found.fitting}
    if len(counts) != 1:
        raise ValueError(
            f"synthesis starts from a search at one micro-batch count, got {sorted(counts)}"
        )
    budget = Budget(base.plan.memory_gib, base.plan.headroom)
    baseline = _baseline(costs, base, budget)
    built = [
        (judged, start, policy)
        for start in _starts(found)
        for judged, policy in _built(costs, start, budget, policies(start.placement))
    ]
    built.sort(key=lambda b: b[0].makespan)
    finalists = [improve_order(costs, baseline, budget, order_budget)]
    for judged, start, policy in built[:FINALISTS]:
        judged = improve_cut(judged, _rebuilder(costs, start, policy, budget))
        finalists.append(improve_order(costs, judged, budget, order_budget))
    best = finalists[0]
    for judged in finalists[1:]:
        if judged.better_than(best):
            best = judged
    program = best.program
    return Synthesis(
        program=Program(
            program.placement, program.num_microbatches, program.actions, "synthesized"
        ),
        stage_layers=best.cut,
        recompute=best.recompute,
        timeline=best.timeline,
        peak_gib=best.peaks,
        baseline=base.plan,
        baseline_timeline=base.timeline,
        how=best.how,
        static_gib=_static(costs, best),
    )


def _rebuilder(
    costs: ModelCosts, start: Start, policy: OrderPolicy, budget: Budget
) -> Callable[[tuple[int, ...]], Judged | None]:
    """``start`` cut as given and ordered by ``policy`` again (``improve_cut``'s step)."""

    def rebuild(cut: tuple[int, ...]) -> Judged | None:
        moved = replace(start, cut=cut)
        options = [j for j, _ in _built(costs, moved, budget, [policy])]
        return min(options, key=lambda j: j.makespan, default=None)

    return rebuild


def _static(costs: ModelCosts, judged: Judged) -> tuple[float, ...]:
    program = judged.program
    sc = stage_costs(costs, program, judged.cut, judged.recompute).per_stage(program.num_stages)
    return tuple(per_rank(sc.static, program.placement.rank_of_stage, program.num_ranks))


def synthesize_orders(
    costs: ModelCosts,
    placement: Placement,
    num_microbatches: int,
    cut: Sequence[int],
    budget: Budget,
    recompute: Sequence[str] = (),
    *,
    order_budget: int = ORDER_BUDGET,
) -> Judged | None:
    """The heuristic alone on one placement and cut: the best greedy variant, improved by the
    order's local search (``None``: no variant fits). What ``synthesize_exact`` measures."""
    modes = tuple(recompute) or ("none",) * len(cut)
    start = Start(placement, num_microbatches, tuple(cut), modes, "the given cut")
    built = [j for j, _ in _built(costs, start, budget, policies(placement))]
    if not built:
        return None
    best = min(built, key=lambda j: j.makespan)
    return improve_order(costs, best, budget, order_budget)


def synthesize_plan(
    costs: ModelCosts, found: Search, *, order_budget: int = ORDER_BUDGET
) -> Synthesis:
    """The planner's ``synthesized`` option: a synthesis at each micro-batch count ``found``
    tried (from its candidates at that count), the fastest per micro-batch of them, beside the
    planner's fastest pick that offloads nothing — never slower per micro-batch than it, as the
    pick's own count is among those synthesized. ``NoPlanFits`` where only offloading plans
    fit."""
    plain = replace(found, candidates=[c for c in found.candidates if not c.plan.layout.offloads])
    pick = plain.best
    results = []
    for m in sorted({c.plan.microbatches for c in plain.fitting}):
        at_m = replace(plain, candidates=[c for c in plain.candidates if c.plan.microbatches == m])
        results.append(synthesize_from_search(costs, at_m, order_budget=order_budget))
    best = min(results, key=lambda r: r.ms_per_microbatch)
    return replace(best, baseline=pick.plan, baseline_timeline=pick.timeline)


@dataclass(frozen=True)
class Start:
    """A placement, cut and recompute to build orders for."""

    placement: Placement
    num_microbatches: int
    cut: tuple[int, ...]
    recompute: tuple[str, ...]
    how: str


def _baseline(costs: ModelCosts, base: Candidate, budget: Budget) -> Judged:
    plan = base.plan
    program = _family_program(plan)
    judged = judge(costs, program, plan.stage_layers, plan.recompute, budget, plan.schedule)
    assert judged is not None, "the planner's pick does not validate"
    return judged


def _family_program(plan: Plan) -> Program:
    return build_schedule(plan.schedule, plan.ranks, plan.microbatches, plan.stages_per_rank)


def _starts(found: Search) -> list[Start]:
    """The fastest fitting distinct (cut, recompute) of each placement the synthesis builds."""
    out: list[Start] = []
    for v in (1, 2):
        seen: set[tuple[tuple[int, ...], tuple[str, ...]]] = set()
        ranked = sorted(found.fitting, key=lambda c: c.plan.ms_per_microbatch)
        for c in ranked:
            p = c.plan
            if p.stages_per_rank != v or p.layout.offloads or len(p.stage_layers) != v * p.ranks:
                continue
            if v == 2 and p.schedule not in _V_FAMILIES:
                continue
            key = (p.stage_layers, p.recompute)
            if key in seen:
                continue
            seen.add(key)
            placement = one_per_rank(p.ranks) if v == 1 else v_shape(p.ranks)
            out.append(Start(placement, p.microbatches, *key, f"{p.schedule}'s cut"))
            if len(seen) == STARTS_PER_PLACEMENT:
                break
    return out


#: the families whose placement is the V (their cuts are V cuts)
_V_FAMILIES = ("zbv", "dualpipev", "v-half", "v-min")


def policies(placement: Placement) -> list[OrderPolicy]:
    """The greedy rule's variants tried on ``placement`` (their memory caps are set per cut)."""
    p = placement.num_ranks
    v_placed = placement.kind is PlacementKind.V
    depth_rules: list[tuple[int, ...]] = [
        (),
        tuple(max(1, p - r) for r in range(p)),
        tuple(max(1, 2 * p - 1 - 2 * r) for r in range(p)),
    ]
    return [
        OrderPolicy((), in_flight, fill, deep, early_release=early)
        for in_flight in depth_rules
        for fill in ("fits", "eager")
        for deep in ((True, False) if v_placed else (True,))
        for early in (True, False)
    ]


def _built(
    costs: ModelCosts, start: Start, budget: Budget, variants: Sequence[OrderPolicy]
) -> list[tuple[Judged, OrderPolicy]]:
    """Each variant's program for ``start`` that validates and fits, judged, with the variant; a
    variant whose judged peak overshoots is built again with its ranks' caps lowered by the
    excess (at most three times)."""
    shell = Program(
        start.placement,
        start.num_microbatches,
        tuple(() for _ in range(start.placement.num_ranks)),
    )
    sc = stage_costs(costs, shell, start.cut, start.recompute).per_stage(shell.num_stages)
    times = StageTimes(
        forward=sc.forward,
        backward_input=sc.backward_input,
        backward_weight=sc.backward_weight,
        backward=sc.backward,
        comm=sc.comm,
        activation=sc.activation,
        activation_for_weight=sc.activation_for_weight,
    )
    caps = _activation_caps(start.placement, sc.static, sc.workspace, sc.weight_workspace, budget)
    out = []
    for variant in variants:
        policy = replace(variant, memory=caps, split=costs.split_backward)
        for _ in range(4):
            program = greedy_program(start.placement, start.num_microbatches, times, policy)
            judged = judge(
                costs, program, start.cut, start.recompute, budget, _label(start, policy)
            )
            if judged is None:
                break
            over = [max(0.0, pk - budget.usable) for pk in judged.peaks]
            if not any(over):
                out.append((judged, variant))
                break
            policy = replace(
                policy, memory=tuple(c - o * 1.01 for c, o in zip(policy.memory, over))
            )
    return out


def _activation_caps(
    placement: Placement,
    static: Sequence[float],
    workspace: Sequence[float],
    weight_workspace: Sequence[float],
    budget: Budget,
) -> tuple[float, ...]:
    caps = []
    for r in range(placement.num_ranks):
        stages = placement.stages_of_rank(r)
        held = budget.usable - sum(static[s] for s in stages)
        extra = max(
            max(workspace[s] for s in stages),
            max((weight_workspace[s] for s in stages), default=0.0) if weight_workspace else 0.0,
        )
        caps.append(held - extra if budget.usable < math.inf else math.inf)
    return tuple(caps)


def _label(start: Start, policy: OrderPolicy) -> str:
    depth = "memory only" if not policy.in_flight else f"in flight {list(policy.in_flight)}"
    chunk = (
        ", later chunk first"
        if policy.deep_first and start.placement.num_stages > start.placement.num_ranks
        else ""
    )
    placement = "V placement" if start.placement.kind is PlacementKind.V else "1 stage per rank"
    held = "" if policy.early_release else "; activations held whole to W"
    return f"greedy on {start.how} ({placement}; {depth}; W fill {policy.fill}{chunk}{held})"
