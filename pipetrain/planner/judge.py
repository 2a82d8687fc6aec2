"""How the planner judges one cut: a stage's costs are the sums of its layers' (the costs
file), the program is simulated with them (``sim.simulate``), and each rank's peak memory is the
simulator's own model (``sim.costs.rank_peak_memory``: static memory of the rank's stages plus
its peak of held activations over the simulated step), so the planner has one memory model, not
two. A stage that recomputes is judged with its layers' costs under that mode
(``recompute.recomputed_layer``), so recompute too is only other numbers to the simulator. A
stage that offloads (PipeOffload, arXiv 2503.01328) is judged on its program with the copies
inserted (``schedule.offload``), its reloads as far ahead of their backward as the just-in-time
rule needs (``reload_leads``: the plan records them, so the runtime places them alike), its
first layers moved layer by layer at the costs file's ``host_bandwidth_gbs``
(``sim.offload_model``), so the simulator's copy engine says what it costs and saves. An eager
profile's host and device times (``LayerCost.has_issue_times``) make the simulator pace each rank
by its host as well as its device (``sim.costs``).
A ``Plan`` is what comes out: everything a ``Pipeline`` needs besides the model, with its
prediction."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetrain.planner.costs_file import LayerCost, ModelCosts
from pipetrain.planner.costs_file_moe import stage_all_to_all_ms
from pipetrain.planner.layout import Layout
from pipetrain.planner.partition import bounds
from pipetrain.planner.recompute import beside_later_layers, layers_under, raised
from pipetrain.planner.recompute_modes import Recompute, StageRecompute, stage_recompute
from pipetrain.schedule.offload import insert_offload, offloadable_stages, reload_leads
from pipetrain.schedule.program import Program
from pipetrain.schedule.timeline import Timeline
from pipetrain.sim.bound import ActionCounts, step_lower_bound
from pipetrain.sim.costs import Costs, rank_peak_memory
from pipetrain.sim.simulate import reload_timing, simulate

#: share of the budget kept free by default for what a costs file cannot see: the allocator's
#: fragmentation (reserved above allocated), NCCL's buffers, the optimizer step's temporaries and
#: the memory model's own error (a pick predicted exactly at its budget measured over it:
#: docs/planning.md)
DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class Budget:
    """The budget per rank as given, and the share of it kept free."""

    memory_gib: float
    headroom: float

    @property
    def usable(self) -> float:
        return self.memory_gib * (1.0 - self.headroom)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """A pipeline layout and its simulated step: everything needed to build and run it."""

    layout: Layout
    step_ms: float
    bubble_fraction: float
    peak_gib: tuple[float, ...]
    #: the budget per rank as given, and the share of it kept free
    memory_gib: float
    headroom: float = 0.0
    layer_names: tuple[str, ...] = ()

    @property
    def schedule(self) -> str:
        return self.layout.schedule

    @property
    def ranks(self) -> int:
        return self.layout.ranks

    @property
    def stages_per_rank(self) -> int:
        return self.layout.stages_per_rank

    @property
    def microbatches(self) -> int:
        return self.layout.microbatches

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return self.layout.stage_layers

    @property
    def recompute(self) -> tuple[str, ...]:
        return self.layout.recompute

    @property
    def offload(self) -> tuple[float, ...]:
        return self.layout.offload

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
            **self.layout.to_json(),
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


def rank_key(c: Candidate) -> tuple[float, float, int, float, str]:
    """Faster per micro-batch first; at equal speed less offloaded, then less recomputed (what
    the simulator times as free still moves bytes and runs kernels: a plan offloads or
    recomputes only where memory asks for it), then the lower peak."""
    layout = c.plan.layout
    recomputed = sum(
        raised(spec.mode) * spec.layers_of(n)
        for spec, n in zip(map(stage_recompute, layout.recompute), layout.stage_layers)
    )
    return (
        c.plan.ms_per_microbatch,
        sum(layout.offload),
        recomputed,
        max(c.plan.peak_gib),
        c.plan.schedule,
    )


def family_key(c: Candidate) -> tuple[bool, float, float, int, float, str]:
    """Fitting candidates first, then ``rank_key``."""
    return (not c.plan.fits, *rank_key(c))


#: bytes per GiB over bytes per GB: a GiB at ``host_bandwidth_gbs`` GB/s takes this many seconds
_GIB_PER_GB = 2**30 / 1e9


def stage_costs(
    costs: ModelCosts,
    program: Program,
    cut: Sequence[int],
    recompute: Sequence[str] = (),
    offload: Sequence[float] = (),
) -> Costs:
    """Simulator costs of the stages ``cut`` makes: sums over each stage's layers (a stage's
    ``comm`` is its last layer's output transfer, its workspace ``beside_later_layers``'s, its
    ``W``'s the largest of its layers'), each
    layer's costs under its stage's ``recompute`` mode (one per entry of ``cut``; empty: none)
    and each stage offloading its ``offload`` fraction (one per entry of ``cut``; empty: none)."""
    blocks = bounds(cut)
    modes = [stage_recompute(m) for m in recompute] or [StageRecompute(Recompute.NONE)] * len(
        blocks
    )
    assert len(modes) == len(blocks), (recompute, cut)
    per_block = [
        layers_under(costs.layers[a:b], mode, a, costs.num_layers, costs.captured)
        for (a, b), mode in zip(blocks, modes)
    ]
    per_stage = [blocks[s % len(blocks)] for s in range(program.num_stages)]
    whole_at = [modes[s % len(blocks)].mode is Recompute.WHOLE for s in range(program.num_stages)]
    layers_of = [per_block[s % len(blocks)] for s in range(program.num_stages)]

    def total(attr: str) -> list[float]:
        return [sum(getattr(layer, attr) or 0.0 for layer in stage) for stage in layers_of]

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
                for layer in stage
            )
            for stage in layers_of
        ],
        workspace=[beside_later_layers(stage) for stage in layers_of],
        weight_workspace=[
            # a stage recomputed as a whole runs its W as a plain stage does (``whole_stage``)
            max(x.workspace for x in (costs.layers[a:b] if whole else stage))
            for stage, (a, b), whole in zip(layers_of, per_stage, whole_at)
        ],
        static=total("params"),
        optimizer_workspace=total("optimizer_workspace"),
        host_copy=[a * _GIB_PER_GB / bandwidth * 1e3 for a in total("activation")]
        if (bandwidth := costs.host_bandwidth_gbs)
        else 0.0,
        offload=[offload[s % len(blocks)] for s in range(program.num_stages)] if offload else 0.0,
        layers=[b - a for a, b in per_stage],
        all_to_all=[stage_all_to_all_ms(costs, stage) for stage in layers_of],
        host=_worker_times("host", total, costs) if costs.has_issue_times else None,
        device=_worker_times("device", total, costs) if costs.has_issue_times else None,
    )


def _worker_times(worker: str, total: Callable[[str], list[float]], costs: ModelCosts) -> Costs:
    """A stage's host or device times (an eager profile's, ``sim.costs``): sums over its layers
    (``total``), as its wall times are; the host's with the runtime's own ``host_action_ms`` on
    every action."""
    b = total(f"{worker}_backward")
    if costs.split_backward:
        i, w = total(f"{worker}_backward_input"), total(f"{worker}_backward_weight")
    else:
        i = w = [x / 2 for x in b]
    f = total(f"{worker}_forward")
    extra = (costs.host_action_ms or 0.0) if worker == "host" else 0.0
    f, i, w, b = ([x + extra for x in xs] for xs in (f, i, w, b))
    return Costs(forward=f, backward_input=i, backward_weight=w, backward=b)


def planned_offload(
    costs: ModelCosts,
    program: Program,
    cut: Sequence[int],
    recompute: Sequence[str] = (),
    offload: Sequence[float] = (),
) -> tuple[tuple[float, ...], tuple[int, ...]]:
    """Per position of ``cut``: the offload fraction the runtime can run (``offload``'s, or 0
    where some stage at that position has no micro-batch whose wait hides the copies — the
    just-in-time rule's judgement under the simulator's costs, ``schedule.offload``) and its
    reload lead (``schedule.offload.reload_leads``)."""
    if not any(offload):
        return (), ()
    n, positions = program.num_stages, len(cut)
    sc = stage_costs(costs, program, cut, recompute, offload).per_stage(n)
    timing = reload_timing(sc, n)
    per_stage = [offload[s % positions] for s in range(n)]
    leads = reload_leads(program, per_stage, timing)
    lead = tuple(max(leads[s] for s in range(p, n, positions)) for p in range(positions))
    able = offloadable_stages(program, 1, timing)
    hidden = [
        f if all(s in able for s in range(p, n, positions)) else 0.0 for p, f in enumerate(offload)
    ]
    return usable_offload(program, positions, hidden, lead), lead


def simulate_plan(
    costs: ModelCosts,
    program: Program,
    cut: Sequence[int],
    recompute: Sequence[str] = (),
    offload: Sequence[float] = (),
    reload_lead: Sequence[int] = (),
) -> tuple[Timeline, tuple[float, ...]]:
    """The simulated timeline of ``program`` cut by ``cut`` (each stage recomputing as
    ``recompute`` says and offloading as ``offload`` says, reloading ``reload_lead`` compute
    actions ahead — empty: ``planned_offload``'s) and each rank's peak memory (GiB)."""
    if any(offload) and not reload_lead:
        offload, reload_lead = planned_offload(costs, program, cut, recompute, offload)
    sim_costs = stage_costs(costs, program, cut, recompute, offload)
    if any(offload):
        per_stage = [offload[s % len(cut)] for s in range(program.num_stages)]
        leads = [reload_lead[s % len(cut)] for s in range(program.num_stages)]
        program = insert_offload(program, per_stage, leads)
    timeline = simulate(program, sim_costs)
    peaks = rank_peak_memory(
        timeline, sim_costs.per_stage(program.num_stages), program.placement.rank_of_stage
    )
    return timeline, peaks


def evaluate(
    costs: ModelCosts,
    program: Program,
    name: str,
    v: int,
    cut: tuple[int, ...],
    how: str,
    budget: Budget,
    recompute: Sequence[str] = (),
    offload: Sequence[float] = (),
) -> Candidate:
    """``cut`` of ``program`` simulated and judged against ``budget`` (``how``: where the cut
    came from), each stage recomputing as ``recompute`` says (empty: none) — except a stage whose
    layers hold no parameters, which the runtime refuses to recompute — and offloading as
    ``offload`` says (empty: none) — except a stage none of whose micro-batches waits long enough
    (``schedule.offload``), which the runtime refuses to offload."""
    recompute = tuple(
        _runnable(stage_recompute(mode), costs.layers[a:b])
        for mode, (a, b) in zip(recompute, bounds(cut))
    )
    offload, lead = planned_offload(costs, program, cut, recompute, offload)
    timeline, peaks = simulate_plan(costs, program, cut, recompute, offload, lead)
    return Candidate(
        plan=Plan(
            layout=Layout(
                schedule=str(name),
                ranks=program.num_ranks,
                stages_per_rank=v,
                microbatches=program.num_microbatches,
                stage_layers=cut,
                recompute=tuple(recompute),
                offload=offload,
                reload_lead=lead if any(offload) else (),
            ),
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


def step_bound(
    costs: ModelCosts, counts: ActionCounts, cut: tuple[int, ...], recompute: Sequence[str] = ()
) -> float | None:
    """A lower bound on the step ``evaluate`` would predict for ``cut`` of ``counts.program``
    with ``recompute`` (``sim.bound``: None where it does not apply), from the same stage costs:
    each mode made runnable as ``evaluate`` makes it. Offload is left out: its copies only
    delay compute, so the bound without them holds with them."""
    recompute = tuple(
        _runnable(stage_recompute(mode), costs.layers[a:b])
        for mode, (a, b) in zip(recompute, bounds(cut))
    )
    return step_lower_bound(counts, stage_costs(costs, counts.program, cut, recompute))


def usable_offload(
    program: Program, positions: int, offload: Sequence[float], lead: Sequence[int] = ()
) -> tuple[float, ...]:
    """``offload`` (one fraction per position of the cut; empty: none) with 0 where no stage at
    that position has a micro-batch ``insert_offload`` would offload at its position's ``lead``
    (empty: 1) — it would refuse them."""
    if not any(offload):
        return ()
    per_stage = [lead[s % positions] for s in range(program.num_stages)] if lead else 1
    able = offloadable_stages(program, per_stage)
    return tuple(
        f if all(s in able for s in range(pos, program.num_stages, positions)) else 0.0
        for pos, f in enumerate(offload)
    )


def _runnable(spec: StageRecompute, layers: Sequence[LayerCost]) -> str:
    """``spec`` as the runtime runs it on a stage of ``layers`` (a cut moved since the mode was
    chosen may leave fewer layers than it names: then all of them), or ``"none"`` where none of
    the layers holds parameters (the runtime refuses to recompute such a stage)."""
    if spec.mode is Recompute.NONE or not any(x.params > 0 for x in layers):
        return Recompute.NONE.value
    if spec.layers is not None and spec.layers >= len(layers):
        return spec.mode.value
    return str(spec)
