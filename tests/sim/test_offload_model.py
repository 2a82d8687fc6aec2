"""The simulator's offload model (``sim.offload_model``): one piece as before, layer by layer with
its copy streaming during the forward, a couple of layers held, the backward starting before the
whole reload is back, and the memory curve returning to zero whatever moved."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.action import OpKind
from pipetrain.schedule.lower import lower
from pipetrain.schedule.offload import insert_offload, offloadable_stages
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.sim.costs import Costs
from pipetrain.sim.offload_model import stage_offload
from pipetrain.sim.simulate import reload_timing, simulate


def test_one_piece_moves_the_share_after_the_forward() -> None:
    sc = Costs(activation=2.0, host_copy=0.8, offload=0.5).per_stage(1)
    one = stage_offload(sc, 0)
    assert (one.moved, one.out, one.back) == (1.0, 1.0, 1.0)
    assert (one.plan.offload, one.plan.reload, one.plan.early) == (0.4, 0.4, 0.0)
    assert one.plan.need_b is None  # the backward waits for the whole reload


def test_layer_by_layer_numbers() -> None:
    # 4 layers, the first 2 offloaded; a layer copies in 0.1, computes forward 0.25, backward 0.5
    sc = Costs(activation=1.0, host_copy=0.4, offload=0.5, layers=4, backward_input=1.0,
               backward_weight=1.0).per_stage(1)  # fmt: skip
    two = stage_offload(sc, 0)
    assert two.moved == pytest.approx(0.5)
    assert two.out == pytest.approx(0.5)  # RESIDENT_LAYERS of them at most
    assert two.back == pytest.approx(0.25)  # one layer back while two kept ones wait
    assert stage_offload(Costs(offload=1.0, layers=4).per_stage(1), 0).back == 0.5  # none kept
    assert two.plan.early == pytest.approx(0.75)  # starts when the first layer's forward ends
    assert two.plan.offload == pytest.approx(0.35)  # the second layer's copy ends 0.1 after it
    assert two.plan.reload == pytest.approx(0.2)
    assert two.plan.need_b == pytest.approx(max(0.1 - 2 * 0.5, 0.2 - 3 * 0.5))  # hidden
    # copies 10x slower than compute: the forward ends with a backlog, which it holds
    slow = stage_offload(Costs(host_copy=40.0, offload=1.0, layers=4).per_stage(1), 0)
    backlog = 4 - 0.75 / 10.0
    assert slow.out == pytest.approx(backlog / 4)
    assert slow.plan.need_b == pytest.approx(4 * 10.0 - 3 * 0.5)  # the backward waits, copy-bound


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(list(FAMILIES)),
    p=st.integers(2, 5),
    m=st.integers(2, 12),
    layers=st.integers(1, 6),
    fraction=st.floats(0.05, 1.0),
    copy=st.floats(0.0, 4.0),
)
def test_copies_stream_and_backwards_wait_for_what_they_read(
    name, p, m, layers, fraction, copy
) -> None:
    try:
        program = lower(build_schedule(name, p, m, 2 if FAMILIES[name].multi_stage else None))
    except ValueError:
        return
    n = program.num_stages
    able = offloadable_stages(program, 1)
    fractions = [fraction if s in able else 0.0 for s in range(n)]
    if not any(fractions):
        return
    costs = Costs(host_copy=copy, layers=layers, offload=fractions)
    sc = costs.per_stage(n)
    timeline = simulate(insert_offload(program, fractions, 1), costs)
    plain = simulate(program)
    assert timeline.makespan >= plain.makespan - 1e-9
    for curve in timeline.memory:  # everything allocated is freed by the step's end
        assert curve[-1][1] == pytest.approx(0.0, abs=1e-9)
    forward = {(s.action.stage, s.action.microbatch): s for s in timeline.spans
               if s.action.kind is OpKind.F}  # fmt: skip
    reload = {(s.action.stage, s.action.microbatch): s for s in timeline.copies
              if s.action.kind is OpKind.RELOAD}  # fmt: skip
    timing = reload_timing(sc, n)
    for s in timeline.copies:
        key = (s.action.stage, s.action.microbatch)
        if s.action.kind is OpKind.OFFLOAD and key in forward and layers > 1:
            f = forward[key]  # streams during its forward, from its first layer's end
            assert s.start >= f.start + (f.end - f.start) / layers - 1e-9
    for span in timeline.spans:
        for part in span.action.compute_parts:
            key = (part.stage, part.microbatch)
            if part.kind in (OpKind.B, OpKind.I) and key in reload:
                need = max(0.0, timing.need(part))
                assert span.start >= reload[key].start + min(need, reload[key].duration) - 1e-9
