"""V-Half and V-Min (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).

Sweeps (ranks 1–16, micro-batches 1–64) check that every program validates, is complete and
stays within the published peak; from m >= p on, the peak is exactly the published one —
⌊(p + 2)/2⌋ (V-Half) and ⌊(p + 4)/3⌋ (V-Min) micro-batches of a rank's share, against 1F1B's p —
and the bubble at F = I = W is at most 1/2 (V-Half) or 2/3 (V-Min) of 1F1B's under the same costs,
both simulated. One V stage is half a rank's share, so a V peak of k chunk-units is k/2 of 1F1B's
units.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.action import OpKind
from pipetrain.schedule.builders.controllable_memory import (
    INTERVAL,
    build_v_half,
    build_v_min,
    v_half_offsets,
    v_min_offsets,
)
from pipetrain.schedule.builders.one_f_one_b import build_1f1b
from pipetrain.schedule.lower import lower
from pipetrain.schedule.placement import PlacementKind
from pipetrain.schedule.registry import FAMILIES, ScheduleName, build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate

UNIT = Costs(forward=1, backward_input=1, backward_weight=1, comm=0)
# 1F1B with the same model: one stage per rank is two V stages, so each pass costs twice as much
ONE_F_ONE_B_UNIT = Costs(forward=2, backward_input=2, backward_weight=2, comm=0)
SWEEP = settings(max_examples=60, deadline=None)

# name -> (builder, published peak in micro-batches of a rank's share, bubble vs 1F1B's)
PUBLISHED = {
    "v-half": (build_v_half, lambda p: (p + 2) // 2, Fraction(1, 2)),
    "v-min": (build_v_min, lambda p: (p + 4) // 3, Fraction(2, 3)),
}


def _parts(program) -> Counter[tuple[OpKind, int, int]]:
    return Counter(
        (part.kind, part.stage, part.microbatch)
        for row in program.actions
        for action in row
        for part in action.compute_parts
    )


@SWEEP
@given(st.sampled_from(sorted(PUBLISHED)), st.integers(1, 16), st.integers(1, 64))
def test_valid_complete_and_within_published_peak(name: str, p: int, m: int) -> None:
    builder, published_peak, bubble_ratio = PUBLISHED[name]
    program = validate(builder(p, m))
    assert program.name == name and program.placement.kind is PlacementKind.V
    assert program.num_stages == 2 * p and not program.is_lowered
    expected = Counter(
        (kind, s, j)
        for kind in (OpKind.F, OpKind.I, OpKind.W)
        for s in range(2 * p)
        for j in range(m)
    )
    assert _parts(program) == expected
    validate(lower(program))

    timeline = simulate(program, UNIT)
    peak = published_peak(p)
    assert max(timeline.peak_activations) <= 2 * peak  # chunk-units: two per share
    if m < p:
        return
    one_f_one_b = simulate(build_1f1b(p, m), ONE_F_ONE_B_UNIT)
    assert max(one_f_one_b.peak_activations) == p
    assert max(timeline.peak_activations) == 2 * peak
    work = 6 * m  # per rank: two stages × (F + I + W), the same for 1F1B's one double stage
    bubble = max(timeline.rank_spans) - work
    one_f_one_b_bubble = max(one_f_one_b.rank_spans) - work
    assert one_f_one_b_bubble == 6 * (p - 1)
    assert bubble <= bubble_ratio * one_f_one_b_bubble, (bubble, one_f_one_b_bubble)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_steady_state_has_no_bubble(name: str, p: int) -> None:
    """Each micro-batch past the warm-up adds exactly its work, 6 slots, to every rank's span:
    the block repeats every INTERVAL without idling (the bubble is the ramps' alone)."""
    builder = PUBLISHED[name][0]
    m = 2 * p + 2
    shorter, longer = (simulate(builder(p, k), UNIT).rank_spans for k in (m, m + 3))
    assert [b - a for a, b in zip(shorter, longer)] == [3 * INTERVAL] * p


@pytest.mark.parametrize(
    ("offsets", "lifespans"),
    [(v_min_offsets, lambda p, g: 4 * p + 2 * g), (v_half_offsets, lambda p, g: 6 * p - 1 + 2 * g)],
)
@pytest.mark.parametrize("p", range(1, 33))
def test_blocks_repeat_without_collision_and_balance_lifespans(offsets, lifespans, p) -> None:
    """The block is a valid one-micro-batch schedule, its four slots differ modulo the interval
    (so its repeats never collide), and every rank's two F→I lifespans add up to the same total
    (the paper's lifespan argument: equal totals, equal memory on every rank)."""
    gap = {v_min_offsets: 2 * (p % 3 == 0), v_half_offsets: 3 * (p % 2 == 0)}[offsets]
    blocks = [offsets(p, r) for r in range(p)]
    for r, (f0, f1, i1, i0) in enumerate(blocks):
        assert len({o % INTERVAL for o in (f0, f1, i1, i0)}) == 4, (r, blocks[r])
        assert (i0 - f0) + (i1 - f1) == lifespans(p, gap)
        if r > 0:  # down the V, and the chunk-1 backward comes down too
            assert f0 > blocks[r - 1][0] and i1 > blocks[r - 1][2]
        if r < p - 1:  # back up the V, and the chunk-0 backward goes up
            assert f1 > blocks[r + 1][1] and i0 > blocks[r + 1][3]
    assert blocks[p - 1][1] > blocks[p - 1][0]  # the turn at the bottom of the V
    assert blocks[0][2] > blocks[0][1]  # the loss on the last stage (rank 0, chunk 1)
    assert blocks[p - 1][3] > blocks[p - 1][2]  # the backward turns at the bottom


def test_unit_facts_p4_m8() -> None:
    """p = 4, m = 8 at F = I = W = 1: peaks 6 and 4 chunk-units (3 and 2 shares, 1F1B: 4), spans
    48 + bubble with the bubble 5 and 11 against 1F1B's 18."""
    v_half = simulate(build_v_half(4, 8), UNIT)
    assert v_half.peak_activations == (6, 6, 6, 6)
    assert v_half.rank_spans == (53, 51, 51, 50)
    v_min = simulate(build_v_min(4, 8), UNIT)
    assert v_min.peak_activations == (4, 4, 4, 4)
    assert v_min.rank_spans == (59, 57, 55, 54)
    one_f_one_b = simulate(build_1f1b(4, 8), ONE_F_ONE_B_UNIT)
    assert one_f_one_b.peak_activations == (4, 3, 2, 1)
    assert one_f_one_b.rank_spans[0] == 66


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_registered_runnable_and_shapes_refused_by_name(name: str) -> None:
    fam = FAMILIES[ScheduleName(name)]
    assert fam.runnable and fam.stages_per_rank == (2,)
    assert build_schedule(name, 4, 8).actions == PUBLISHED[name][0](4, 8).actions
    for v in (1, 3):
        with pytest.raises(ValueError, match=rf"{name} needs stages_per_rank = 2, got {v}"):
            build_schedule(name, 4, 8, stages_per_rank=v)
    for p, m in [(0, 8), (4, 0), (-1, 8), (True, 8), (4, 2.0)]:
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            build_schedule(name, p, m)
