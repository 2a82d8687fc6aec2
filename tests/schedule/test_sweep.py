"""Hypothesis sweeps over every builder: ranks 1–16, stages per rank 1–4, micro-batches 1–64.

For every shape a family accepts: lowering validates, each (stage, micro-batch) has its F and its
backward pieces exactly once, peak memory respects the family's published bound, and the
simulated makespan is never below the busiest rank's work; the runtime's transport model runs it
with receives where lowering puts them and posted late (``post_receives_late``). Shapes a family refuses raise a plain
``ValueError`` (not a ``ScheduleError``): the builder knew, nothing was half-built.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.runtime.resolve import forward_only
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.builders.interleaved import legal_group_sizes
from pipetrain.schedule.lower import lower, post_receives_late
from pipetrain.schedule.program import ScheduleError
from pipetrain.schedule.registry import FAMILIES, ScheduleName, build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate

SPLIT = {
    ScheduleName.ZB_H1,
    ScheduleName.ZB_H2,
    ScheduleName.INTERLEAVED_ZB,
    ScheduleName.ZBV,
    ScheduleName.V_HALF,
    ScheduleName.V_MIN,
}


def peak_bound(name: ScheduleName, p: int, v: int, m: int) -> int:
    """Published peak activations per rank, in stage units (docs/schedules.md)."""
    match name:
        case ScheduleName.GPIPE | ScheduleName.LOOPED_BFS:
            return m * v
        case ScheduleName.ONE_F_ONE_B | ScheduleName.ZB_H1:
            return min(p, m)
        case ScheduleName.ZB_H2:
            return min(2 * p - 1, m)
        case ScheduleName.INTERLEAVED_1F1B:
            # Megatron's warm-up on rank 0 plus the one in flight (Narayanan et al. 2021)
            g = legal_group_sizes(p, m)[0]
            return min(2 * (p - 1) + (v - 1) * g + 1, m * v)
        case ScheduleName.INTERLEAVED_ZB:
            # torch's zero-bubble warm-up plus the deferred W (lag <= p - 1)
            g = legal_group_sizes(p, m)[0]
            return min((p - 1) + (v - 1) * g + 1 + (p - 1), m * v)
        case ScheduleName.ZBV:
            return 2 * p
        case ScheduleName.DUALPIPEV:
            return 2 * p + 1
        case ScheduleName.DUALPIPE:
            return p + 1
        case ScheduleName.V_HALF:  # Qi et al. 2024 (controllable memory): (p + 2) // 2 shares
            return 2 * ((p + 2) // 2)
        case ScheduleName.V_MIN:  # and (p + 4) // 3 shares, two chunk-units each
            return 2 * ((p + 4) // 3)
    raise AssertionError(name)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(list(FAMILIES)),
    p=st.integers(1, 16),
    v=st.integers(1, 4),
    m=st.integers(1, 64),
    costs=st.tuples(st.floats(0.1, 4), st.floats(0.1, 4), st.floats(0.1, 4), st.floats(0, 1)),
    lead=st.integers(0, 3),
)
def test_every_accepted_shape_lowers_validates_and_simulates(name, p, v, m, costs, lead) -> None:
    fam = FAMILIES[name]
    stages_per_rank = v if fam.multi_stage else None
    try:
        program = build_schedule(name, p, m, stages_per_rank)
    except ScheduleError as e:  # pragma: no cover - a builder bug, shown with its grid
        raise AssertionError(f"{name} built an invalid program:\n{e}") from e
    except ValueError as e:
        assert "legal" in str(e) or "must be" in str(e) or "needs" in str(e), str(e)
        return
    num_stages = program.num_stages
    assert num_stages == p * (v if fam.multi_stage else fam.default_stages_per_rank)
    parts: dict[OpKind, int] = dict.fromkeys((OpKind.F, OpKind.B, OpKind.I, OpKind.W), 0)
    for row in program.actions:
        for action in row:
            for part in action.compute_parts:
                parts[part.kind] += 1
    pieces = program.placement.stages_per_chain * m  # each micro-batch runs one chain
    assert parts[OpKind.F] == pieces
    if name in SPLIT:
        assert parts[OpKind.I] == parts[OpKind.W] == pieces and parts[OpKind.B] == 0
    elif name in (
        ScheduleName.DUALPIPEV,
        ScheduleName.DUALPIPE,
    ):  # full B, and I + W where it defers (zero bubble)
        assert parts[OpKind.B] + parts[OpKind.I] == pieces and parts[OpKind.I] == parts[OpKind.W]
    else:
        assert parts[OpKind.B] == pieces and parts[OpKind.I] == parts[OpKind.W] == 0
    lowered = validate(lower(program))
    # the runtime's transport runs it too, with receives posted as late as ``lead`` allows
    validate(lowered, "posted")
    validate(post_receives_late(lowered, lead), "posted")
    forward_only(lowered, lead)  # eval's program, its receives moved alike (checked inside)
    f, i, w, c = costs
    timeline = simulate(lowered, Costs(forward=f, backward_input=i, backward_weight=w, comm=c))
    assert timeline.makespan >= max(timeline.busy) - 1e-9
    unit = simulate(program)
    bound = peak_bound(name, p, v if fam.multi_stage else fam.default_stages_per_rank, m)
    assert max(unit.peak_activations) <= bound, (unit.peak_activations, bound)
