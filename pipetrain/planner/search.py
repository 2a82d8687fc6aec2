"""The planner: schedule family × stages per rank × micro-batches × layer boundaries, each
candidate simulated, the fastest per micro-batch that fits the memory budget chosen.

Why this search is enough (docs/planning.md states it in full): for a given schedule shape
(family, stages per rank ``v``, micro-batches ``M``) the step of every schedule is at least ``M``
times the busiest stage's forward + backward, and the steady state of the registry's families
runs at that pace, so the cuts that minimise the busiest stage (``partition.min_max_cut``, exact;
filled from the front, from the back, and evenly) are the ones to beat; with several stages per
rank a rank-balanced cut joins them, the uniform cut always does, and when the fastest does not
fit, the same exact search runs under per-stage memory caps derived from the simulated in-flight
counts. The simulation judges them all, then refines the best cuts of the fastest shapes by
moving boundaries one layer at a time (``_refine``). The memory model is the simulator's
(``sim.costs.rank_peak_memory``): static memory of a rank's stages plus its peak of held
activations over the simulated step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pipetrain.planner.costs_file import ModelCosts
from pipetrain.planner.partition import (
    bounds,
    even_min_max_cut,
    min_max_cut,
    rank_balanced_cut,
    uniform_cut,
)
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.program import Program
from pipetrain.schedule.registry import FAMILIES, Family, build_schedule, family
from pipetrain.schedule.timeline import Timeline
from pipetrain.sim.costs import Costs, rank_peak_memory
from pipetrain.sim.simulate import simulate

#: stages per rank tried for the families that take any number
DEFAULT_STAGES_PER_RANK = (1, 2, 3, 4)
#: micro-batch counts tried (as multiples of the ranks) when none are given
DEFAULT_MICROBATCH_FACTORS = (1, 2, 4)
#: the fitting shapes (family, stages per rank, micro-batches) whose best cut is refined
REFINE_SHAPES = 3
#: compute actions the refinement may simulate in all (a few microseconds each)
REFINE_ACTIONS = 1_000_000
#: rounds of tightening the per-stage memory caps towards the budget
_MEMORY_ROUNDS = 3
#: share of the budget kept free by default for what a costs file cannot see: the allocator's
#: fragmentation (reserved above allocated), NCCL's buffers, the optimizer step's temporaries and
#: the memory model's own error (a pick predicted at its budget measured 2.2% over it on an H200,
#: docs/planning.md)
DEFAULT_HEADROOM = 0.10


class NoPlanFits(ValueError):
    """No candidate fits the memory budget; the message names the smallest peak reached."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A pipeline layout and its simulated step: everything needed to build and run it."""

    schedule: str
    ranks: int
    stages_per_rank: int
    microbatches: int
    #: layers per stage, in stage order (for DualPipe's two model copies: one copy's stages)
    stage_layers: tuple[int, ...]
    step_ms: float
    bubble_fraction: float
    peak_gib: tuple[float, ...]
    #: the budget per rank as given, and the share of it kept free
    memory_gib: float
    headroom: float = 0.0
    layer_names: tuple[str, ...] = ()

    @property
    def usable_gib(self) -> float:
        """What a rank's predicted peak may reach: the budget less the headroom."""
        return self.memory_gib * (1.0 - self.headroom)

    @property
    def fits(self) -> bool:
        return max(self.peak_gib) <= self.usable_gib

    @property
    def ms_per_microbatch(self) -> float:
        return self.step_ms / self.microbatches

    def stage_layer_names(self) -> list[list[str]]:
        """The layer names each stage holds (from the costs file)."""
        return [list(self.layer_names[a:b]) for a, b in bounds(self.stage_layers)]

    def to_json(self) -> dict[str, object]:
        return {
            "schedule": self.schedule,
            "ranks": self.ranks,
            "stages_per_rank": self.stages_per_rank,
            "microbatches": self.microbatches,
            "stage_layers": list(self.stage_layers),
            "predicted": {
                "step_ms": self.step_ms,
                "bubble_fraction": self.bubble_fraction,
                "peak_gib": list(self.peak_gib),
            },
        }


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    timeline: Timeline
    #: how its boundaries were found: balanced(-back, -even), uniform, memory(-back, -even)
    cut_by: str


@dataclass
class Search:
    """Every simulated candidate, and the shapes that could not be tried (with the reason)."""

    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[tuple[str, int, int, str]] = field(default_factory=list)

    @property
    def fitting(self) -> list[Candidate]:
        return [c for c in self.candidates if c.plan.fits]

    @property
    def best(self) -> Candidate:
        """The fastest fitting candidate per micro-batch; ``NoPlanFits`` when none fits."""
        fitting = self.fitting
        if not fitting:
            raise NoPlanFits(self._nothing_fits())
        return min(fitting, key=_rank_key)

    def best_per_family(self) -> list[Candidate]:
        """Each family's best candidate (fitting ones first), fastest first."""
        best: dict[str, Candidate] = {}
        for c in self.candidates:
            name = c.plan.schedule
            if name not in best or _family_key(c) < _family_key(best[name]):
                best[name] = c
        return sorted(best.values(), key=_family_key)

    def near(self, fraction: float) -> list[Candidate]:
        """Fitting candidates whose predicted time per micro-batch is within ``fraction`` of the
        pick's (the pick first), one per distinct plan."""
        pick = self.best.plan.ms_per_microbatch
        seen, out = set(), []
        for c in sorted(self.fitting, key=_rank_key):
            key = (
                c.plan.schedule,
                c.plan.stages_per_rank,
                c.plan.microbatches,
                c.plan.stage_layers,
            )
            if c.plan.ms_per_microbatch <= pick * (1 + fraction) and key not in seen:
                seen.add(key)
                out.append(c)
        return out

    def _nothing_fits(self) -> str:
        if not self.candidates:
            reasons = "; ".join(f"{n} v={v} M={m}: {why}" for n, v, m, why in self.skipped[:6])
            return f"no candidate could be built ({reasons})"
        low = min(self.candidates, key=lambda c: max(c.plan.peak_gib))
        p = low.plan
        peak = max(p.peak_gib)
        kept = f" less {p.headroom:.0%} headroom = {p.usable_gib:.3g} GiB" if p.headroom else ""
        return (
            f"no plan fits {p.memory_gib:g} GiB per rank{kept}: the smallest peak any candidate "
            f"reached is {peak:.3f} GiB on rank {p.peak_gib.index(peak)} ({p.schedule}, "
            f"{p.stages_per_rank} stage(s) per rank, {p.microbatches} micro-batches, "
            f"stage_layers {list(p.stage_layers)}); raise --memory-gib, lower --headroom or "
            "add ranks"
        )


def _rank_key(c: Candidate) -> tuple[float, float, str]:
    return (c.plan.ms_per_microbatch, max(c.plan.peak_gib), c.plan.schedule)


def _family_key(c: Candidate) -> tuple[bool, float, float, str]:
    return (not c.plan.fits, *_rank_key(c))


def plan(
    costs: ModelCosts,
    *,
    num_ranks: int,
    memory_gib: float,
    microbatches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    global_batch: int | None = None,
    micro_batch_size: int | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """The fastest plan per micro-batch whose every rank's predicted peak fits ``memory_gib``
    less ``headroom`` (a fraction kept free, see ``DEFAULT_HEADROOM``); ``NoPlanFits`` (a
    ``ValueError``) when none does, naming the smallest peak reached and its rank."""
    return search(
        costs,
        num_ranks=num_ranks,
        memory_gib=memory_gib,
        headroom=headroom,
        microbatches=microbatches,
        schedules=schedules,
        global_batch=global_batch,
        micro_batch_size=micro_batch_size,
    ).best.plan


def search(
    costs: ModelCosts,
    *,
    num_ranks: int,
    memory_gib: float,
    microbatches: Sequence[int] | None = None,
    schedules: Sequence[str] | None = None,
    global_batch: int | None = None,
    micro_batch_size: int | None = None,
    stages_per_rank: Sequence[int] | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> Search:
    """Simulate every candidate (see the module docstring); ``ValueError`` names bad input."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if not memory_gib > 0:
        raise ValueError(f"memory_gib must be > 0, got {memory_gib}")
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom must be a fraction in [0, 1), got {headroom}")
    budget = _Budget(memory_gib, headroom)
    counts = microbatch_options(num_ranks, microbatches, global_batch, micro_batch_size)
    families = [family(n) for n in schedules] if schedules else default_families()
    out = Search()
    programs: dict[tuple[str, int, int], Program] = {}
    for fam in families:
        for v in _stages_per_rank(fam, num_ranks, costs.num_layers, stages_per_rank):
            for m in counts:
                try:
                    program = build_schedule(fam.name, num_ranks, m, v)
                except ValueError as e:
                    out.skipped.append((fam.name, v, m, str(e)))
                    continue
                if program.placement.stages_per_chain > costs.num_layers:
                    out.skipped.append(
                        (
                            fam.name,
                            v,
                            m,
                            f"needs {program.placement.stages_per_chain} stages "
                            f"but the model has {costs.num_layers} layers",
                        )
                    )
                    continue
                if not costs.split_backward and _splits_backward(program):
                    out.skipped.append(
                        (
                            fam.name,
                            v,
                            m,
                            "splits the backward: the costs file gives no "
                            "backward_input/backward_weight",
                        )
                    )
                    continue
                out.candidates += _candidates(costs, program, fam.name, v, budget)
                programs[fam.name, v, m] = program
    _refine(out, costs, programs, budget)
    return out


@dataclass(frozen=True)
class _Budget:
    memory_gib: float
    headroom: float

    @property
    def usable(self) -> float:
        return self.memory_gib * (1.0 - self.headroom)


def default_families() -> list[Family]:
    """Every family ``pipetrain.Pipeline`` runs (a plan is for running)."""
    return [f for f in FAMILIES.values() if f.runnable]


def microbatch_options(
    num_ranks: int,
    microbatches: Sequence[int] | None,
    global_batch: int | None,
    micro_batch_size: int | None,
) -> tuple[int, ...]:
    """The micro-batch counts to try: ``global_batch / micro_batch_size`` when given, else the
    given list, else 1, 2 and 4 times the ranks."""
    if (global_batch is None) != (micro_batch_size is None):
        raise ValueError("give --global-batch and --micro-batch-size together")
    for name, value in (("global_batch", global_batch), ("micro_batch_size", micro_batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if global_batch is not None and micro_batch_size is not None:
        if global_batch % micro_batch_size:
            raise ValueError(
                f"global batch {global_batch} is not a multiple of the micro-batch size "
                f"{micro_batch_size}"
            )
        fixed = global_batch // micro_batch_size
        if microbatches and set(microbatches) != {fixed}:
            raise ValueError(
                f"micro-batches {list(microbatches)} contradict global batch / micro-batch size "
                f"= {fixed}"
            )
        return (fixed,)
    if microbatches:
        bad = [m for m in microbatches if m < 1]
        if bad:
            raise ValueError(f"micro-batch counts must be >= 1, got {bad}")
        return tuple(sorted(set(microbatches)))
    return tuple(f * num_ranks for f in DEFAULT_MICROBATCH_FACTORS)


def _stages_per_rank(
    fam: Family, num_ranks: int, num_layers: int, wanted: Sequence[int] | None
) -> Iterable[int]:
    if fam.stages_per_rank is not None:
        return fam.stages_per_rank
    return [v for v in wanted or DEFAULT_STAGES_PER_RANK if v * num_ranks <= num_layers]


def _splits_backward(program: Program) -> bool:
    return any(
        p.kind in (OpKind.I, OpKind.W) for _, _, a in program.cells() for p in a.compute_parts
    )


def _candidates(
    costs: ModelCosts, program: Program, name: str, v: int, budget: _Budget
) -> list[Candidate]:
    chain = program.placement.stages_per_chain
    time = [layer.forward + layer.backward for layer in costs.layers]
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
    done = [_evaluate(costs, program, name, v, cut, how, budget) for cut, how in cuts.items()]
    if min(done, key=_rank_key).plan.fits:
        return done
    # The fastest cut does not fit: balance time under a per-stage memory cap, the cap of each stage its rank's
    # budget shared among its stages and divided by the simulated in-flight count, tightened
    # where the simulated peak still overshoots.
    scale = [1.0] * program.num_ranks
    reference = min(done, key=lambda c: max(c.plan.peak_gib))
    for _ in range(_MEMORY_ROUNDS):
        inflight = _inflight(reference.timeline, program)
        tried = []
        limit = _memory_limit(costs, program, inflight, budget.usable, scale)
        for cut, how in (
            (min_max_cut(time, chain, limit), "memory"),
            (min_max_cut(time, chain, limit, from_the_back=True), "memory-back"),
            (even_min_max_cut(time, chain, limit), "memory-even"),
        ):
            if cut is not None and cut not in cuts:
                cuts[cut] = how
                tried.append(_evaluate(costs, program, name, v, cut, how, budget))
        done += tried
        if not tried or any(c.plan.fits for c in tried):
            break
        reference = min(tried, key=lambda c: max(c.plan.peak_gib))
        for r, peak in enumerate(reference.plan.peak_gib):
            if peak > budget.usable:
                scale[r] *= budget.usable / peak
    return done


def _refine(out: Search, costs: ModelCosts, programs, budget: _Budget) -> None:
    """Hill-climb the best cuts of the fastest fitting shapes with the simulation as the judge:
    move one boundary by one layer (from the heavier of its two stages first), keep the first
    move that is faster and fits, repeat until none is or the budget of simulated actions is
    spent. What the min-max objective cannot see (fill and drain, comm, W filling bubbles,
    several stages per rank) the simulation can."""
    starts: dict[tuple[str, int, int], Candidate] = {}
    for c in sorted(out.fitting, key=_rank_key):
        key = (c.plan.schedule, c.plan.stages_per_rank, c.plan.microbatches)
        if key not in starts and len(starts) < REFINE_SHAPES:
            starts[key] = c
    actions_left = REFINE_ACTIONS
    time = [layer.forward + layer.backward for layer in costs.layers]
    for (name, v, _), best in starts.items():
        program = programs[name, v, best.plan.microbatches]
        size = sum(len(row) for row in program.actions)
        seen = {best.plan.stage_layers}
        improved = True
        while improved:
            improved = False
            for cut in _neighbours(best.plan.stage_layers, time):
                if cut in seen:
                    continue
                if actions_left < size:
                    return
                actions_left -= size
                seen.add(cut)
                c = _evaluate(costs, program, name, v, cut, "refined", budget)
                out.candidates.append(c)
                if c.plan.fits and _rank_key(c) < _rank_key(best):
                    best, improved = c, True
                    break


#: longest chain of stages whose two-move neighbourhood the refinement searches
PAIR_MOVES_UP_TO = 32


def _neighbours(cut: tuple[int, ...], time: Sequence[float]):
    """One-layer moves first; then, for chains up to ``PAIR_MOVES_UP_TO`` stages, two of them
    (with several stages per rank a rank's load is split over distant stages, so the better
    cut is often two moves away through a worse one)."""
    singles = _moves(cut, time)
    yield from singles
    if len(cut) <= PAIR_MOVES_UP_TO:
        for first in singles:
            yield from _moves(first, time)


def _moves(cut: tuple[int, ...], time: Sequence[float]) -> list[tuple[int, ...]]:
    """Cuts one layer away from ``cut`` (every stage keeping one), the heavier side giving first."""
    load = [sum(time[a:b]) for a, b in bounds(cut)]
    scored = []
    for i in range(len(cut) - 1):
        for give, take in ((i, i + 1), (i + 1, i)):
            if cut[give] > 1:
                moved = list(cut)
                moved[give] -= 1
                moved[take] += 1
                scored.append((load[take] - load[give], tuple(moved)))
    return [c for _, c in sorted(scored)]


def stage_costs(costs: ModelCosts, program: Program, cut: Sequence[int]) -> Costs:
    """Simulator costs of the stages ``cut`` makes: sums over each stage's layers (a stage's
    ``comm`` is its last layer's output transfer, its workspace the largest of its layers')."""
    blocks = bounds(cut)
    per_stage = [blocks[s % len(blocks)] for s in range(program.num_stages)]

    def total(attr: str) -> list[float]:
        return [
            sum(getattr(layer, attr) or 0.0 for layer in costs.layers[a:b]) for a, b in per_stage
        ]

    b = total("backward")
    if costs.split_backward:
        i, w = total("backward_input"), total("backward_weight")
    else:  # never read: families that split the backward are not planned from such costs
        i = w = [x / 2 for x in b]
    return Costs(
        forward=total("forward"),
        backward_input=i,
        backward_weight=w,
        backward=b,
        comm=[costs.layer_comm(e - 1) for _, e in per_stage],
        activation=total("activation"),
        activation_for_weight=[
            sum(
                layer.activation
                if layer.activation_for_weight is None
                else layer.activation_for_weight
                for layer in costs.layers[a:e]
            )
            for a, e in per_stage
        ],
        workspace=[max(layer.workspace for layer in costs.layers[a:e]) for a, e in per_stage],
        static=total("params"),
    )


def simulate_plan(
    costs: ModelCosts, program: Program, cut: Sequence[int]
) -> tuple[Timeline, tuple[float, ...]]:
    """The simulated timeline of ``program`` cut by ``cut`` and each rank's peak memory (GiB)."""
    sim_costs = stage_costs(costs, program, cut)
    timeline = simulate(program, sim_costs)
    peaks = rank_peak_memory(
        timeline, sim_costs.per_stage(program.num_stages), program.placement.rank_of_stage
    )
    return timeline, peaks


def _evaluate(
    costs: ModelCosts,
    program: Program,
    name: str,
    v: int,
    cut: tuple[int, ...],
    how: str,
    budget: _Budget,
) -> Candidate:
    timeline, peaks = simulate_plan(costs, program, cut)
    return Candidate(
        plan=Plan(
            schedule=str(name),
            ranks=program.num_ranks,
            stages_per_rank=v,
            microbatches=program.num_microbatches,
            stage_layers=cut,
            step_ms=timeline.makespan,
            bubble_fraction=timeline.bubble_fraction,
            peak_gib=peaks,
            memory_gib=budget.memory_gib,
            headroom=budget.headroom,
            layer_names=tuple(layer.name for layer in costs.layers),
        ),
        timeline=timeline,
        cut_by=how,
    )


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


def _memory_limit(costs: ModelCosts, program: Program, inflight, memory_gib: float, scale):
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
    caps, counts = [], []
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
