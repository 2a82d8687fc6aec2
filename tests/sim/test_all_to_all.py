"""The expert all-to-all as its own resource: a lone F/B/I waits for its own, an overlapped F&B
pair hides each half's under the other's compute (``sim.costs.overlapped_pair``), zero changes
nothing, and ``sim.all_to_all`` says how much each rank hides."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.action import Action, OpKind, overlap
from pipetrain.schedule.lower import lower
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.all_to_all import all_to_all_share
from pipetrain.sim.costs import Costs, overlapped_pair
from pipetrain.sim.simulate import duration, simulate

times = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(times, times, times, times)
def test_a_pair_lasts_between_its_longer_half_and_both_halves(f, fa, b, ba) -> None:
    pair = overlapped_pair(f, fa, b, ba)
    assert max(f + fa, b + ba) <= pair <= f + fa + b + ba
    assert pair >= fa + ba  # the link moves both halves' bytes
    assert pair >= f + b  # the compute runs both halves
    assert overlapped_pair(f, 0.0, b, 0.0) == f + b


def test_a_lone_action_lasts_its_compute_plus_its_all_to_all() -> None:
    sc = Costs(
        forward=2.0, backward_input=3.0, backward_weight=5.0, all_to_all=[0.5, 0.25]
    ).per_stage(2)
    assert duration(Action(OpKind.F, 0, 0), sc) == 2.5
    assert duration(Action(OpKind.B, 1, 0), sc) == 8.25  # backward: the same bytes again
    assert duration(Action(OpKind.I, 0, 0), sc) == 3.5
    assert duration(Action(OpKind.W, 0, 0), sc) == 5.0  # weight gradients send nothing
    back = Costs(forward=2.0, all_to_all=0.5, all_to_all_backward=1.5).per_stage(1)
    assert duration(Action(OpKind.F, 0, 0), back) == 2.5
    assert duration(Action(OpKind.I, 0, 0), back) == 2.5


def test_a_pair_hides_each_half_under_the_other() -> None:
    sc = Costs(forward=4.0, backward=8.0, all_to_all=3.0).per_stage(2)
    pair = overlap(Action(OpKind.F, 1, 3), Action(OpKind.B, 0, 1))
    assert duration(pair, sc) == 12.0  # 3 + 3 fits under 4 + 8: fully hidden
    slow = Costs(forward=4.0, backward=8.0, all_to_all=7.0).per_stage(2)
    assert duration(pair, slow) == 15.0  # the backward's own chain: 8 + 7
    measured = dataclasses.replace(slow, forward_backward=(20.0, 20.0))
    assert duration(pair, measured) == 20.0  # a measured pair includes everything


def test_simulated_spans_carry_the_all_to_all() -> None:
    program = validate(lower(build_schedule("1f1b", 2, 4)))
    timeline = simulate(program, Costs(forward=1.0, backward=2.0, all_to_all=0.5))
    by_kind = {span.action.kind: span.duration for span in timeline.spans}
    assert by_kind[OpKind.F] == 1.5 and by_kind[OpKind.B] == 2.5


@pytest.mark.parametrize(
    "name, v", [("1f1b", None), ("interleaved-1f1b", 2), ("zbv", 2), ("dualpipev", 2)]
)
def test_zero_all_to_all_changes_nothing(name: str, v: int | None) -> None:
    program = validate(lower(build_schedule(name, 4, 8, v)))
    n = program.num_stages
    costs = Costs(
        forward=[1.0, 1.5] * (n // 2), backward_input=1.25, backward_weight=0.75, comm=0.1
    )
    plain = simulate(program, costs)
    zero = simulate(program, dataclasses.replace(costs, all_to_all=0.0, all_to_all_backward=0.0))
    assert zero.spans == plain.spans
    share = all_to_all_share(program, costs)
    assert share.total == share.hidden == (0.0,) * 4 and share.hidden_share == 0.0


def test_only_overlapped_pairs_hide_the_all_to_all() -> None:
    costs = Costs(forward=2.0, backward_input=2.0, backward_weight=2.0, all_to_all=1.0)
    for name in ("1f1b", "zbv"):
        program = validate(lower(build_schedule(name, 2, 4)))
        share = all_to_all_share(program, costs)
        per_stage = program.num_stages // 2
        assert share.total == (4 * 2 * per_stage * 1.0,) * 2  # every F and B or I, once each
        assert share.hidden == (0.0, 0.0)
    program = validate(lower(build_schedule("dualpipev", 2, 8)))
    share = all_to_all_share(program, costs)
    assert share.total == (32.0, 32.0)
    pairs = [sum(1 for a in row if a.parts) for row in program.actions]
    assert all(pairs)
    # compute (2 + 4) covers the link (1 + 1) in every pair: each pair hides both halves'
    assert share.hidden == tuple(2.0 * n for n in pairs)
    assert share.exposed == tuple(32.0 - 2.0 * n for n in pairs)


def test_a_large_all_to_all_is_partly_hidden_and_favours_dualpipev() -> None:
    costs = Costs(forward=1.0, backward_input=1.0, backward_weight=1.0, all_to_all=3.0)
    steps = {}
    for name in ("zbv", "dualpipev"):
        program = validate(lower(build_schedule(name, 2, 8)))
        share = all_to_all_share(program, costs)
        if name == "zbv":
            assert share.hidden == (0.0, 0.0)
        else:  # the link (3 + 3) outlasts the compute (1 + 2): the pairs hide only part of it
            assert all(0 < h < t for h, t in zip(share.hidden, share.total))
        steps[name] = simulate(program, costs).makespan
    plain = Costs(forward=1.0, backward_input=1.0, backward_weight=1.0)
    base = {n: simulate(validate(lower(build_schedule(n, 2, 8))), plain).makespan for n in steps}
    assert steps["dualpipev"] / base["dualpipev"] < steps["zbv"] / base["zbv"]


def test_a_measured_pair_hides_what_it_does_not_last_beyond_its_compute() -> None:
    program = validate(lower(build_schedule("dualpipev", 1, 2)))
    pairs = sum(1 for a in program.actions[0] if a.parts)
    lone = sum(1 for a in program.actions[0] if a.kind in (OpKind.F, OpKind.B, OpKind.I))
    assert pairs and lone
    costs = Costs(forward=4.0, backward=8.0, all_to_all=3.0, forward_backward=13.0)
    share = all_to_all_share(program, costs)
    assert share.total == ((2 * pairs + lone) * 3.0,)
    assert share.hidden == (pairs * 5.0,)  # 13 - (4 + 8) = 1 of the pair's 6 exposed
    slower = all_to_all_share(program, dataclasses.replace(costs, forward_backward=30.0))
    assert slower.hidden == (0.0,)  # beyond compute by more than it carries: none hidden


def test_micro_batch_weights_scale_compute_not_the_all_to_all() -> None:
    program = validate(lower(build_schedule("1f1b", 1, 2)))
    costs = Costs(forward=2.0, backward=4.0, all_to_all=1.0, microbatch_weights=[3.0, 1.0])
    spans = {
        (s.action.kind, s.action.microbatch): s.duration for s in simulate(program, costs).spans
    }
    assert spans[OpKind.F, 0] == pytest.approx(7.0) and spans[OpKind.F, 1] == pytest.approx(3.0)
    assert spans[OpKind.B, 0] == pytest.approx(13.0)


def test_a_weighted_pair_is_the_pair_of_its_weighted_halves() -> None:
    program = validate(lower(build_schedule("dualpipev", 1, 2)))
    weights = [2.0, 0.5]
    costs = Costs(forward=2.0, backward=4.0, all_to_all=3.0, microbatch_weights=weights)
    pairs = [span for span in simulate(program, costs).spans if span.action.parts]
    assert pairs
    for span in pairs:
        f, b = span.action.parts
        expect = overlapped_pair(2.0 * weights[f.microbatch], 3.0, 4.0 * weights[b.microbatch], 3.0)
        assert span.duration == pytest.approx(expect)


def test_the_device_carries_the_all_to_all_and_the_host_does_not() -> None:
    worker = Costs(forward=0.5, backward=1.0)
    sc = Costs(all_to_all=2.0, host=worker, device=worker).per_stage(2)
    assert sc.device is not None and sc.device.all_to_all == (2.0, 2.0)
    assert sc.host is not None and sc.host.forward_all_to_all(0) == 0.0
    with pytest.raises(ValueError, match="give all_to_all on the costs themselves"):
        Costs(host=dataclasses.replace(worker, all_to_all=1.0), device=worker)


def test_scaling_splits_the_all_to_all_with_the_stage_and_bad_values_are_refused() -> None:
    half = Costs(all_to_all=4.0, all_to_all_backward=2.0).scaled(0.5)
    assert (half.all_to_all, half.all_to_all_backward) == (2.0, 1.0)
    with pytest.raises(ValueError, match="cost all_to_all must be a number"):
        Costs(all_to_all=-1.0).per_stage(1)
    with pytest.raises(ValueError, match="cost all_to_all_backward has 3 values"):
        Costs(all_to_all_backward=[1.0, 1.0, 1.0]).per_stage(2)


stage_times = st.lists(st.floats(min_value=0.0, max_value=10.0), min_size=4, max_size=4)


@settings(max_examples=25, deadline=None)
@given(stage_times, stage_times, stage_times, stage_times)
def test_every_simulated_pair_lies_between_its_longer_half_and_its_halves_in_turn(
    f: list[float], i: list[float], w: list[float], a2a: list[float]
) -> None:
    program = validate(lower(build_schedule("dualpipev", 2, 4)))
    costs = Costs(forward=f, backward_input=i, backward_weight=w, all_to_all=a2a)
    sc = costs.per_stage(4)
    pairs = [s for s in simulate(program, costs).spans if s.action.parts]
    assert pairs
    for span in pairs:
        halves = [duration(p, sc) for p in span.action.parts]  # each half alone, with its own
        assert max(halves) - 1e-9 <= span.duration <= sum(halves) + 1e-9
    share = all_to_all_share(program, costs)
    assert all(0 <= h <= t + 1e-9 for h, t in zip(share.hidden, share.total))
