"""Micro-batches of unequal work: ``Costs.microbatch_weights`` scales each one's compute times."""

from __future__ import annotations

import pytest

from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate

FAMILIES = [
    ("gpipe", None),
    ("1f1b", None),
    ("zb-h1", None),
    ("interleaved-1f1b", 2),
    ("zbv", None),
    ("dualpipev", None),
]


@pytest.mark.parametrize(("name", "v"), FAMILIES)
def test_a_uniform_weight_scales_the_whole_timeline(name, v) -> None:
    program = build_schedule(name, 4, 8, v)
    base = Costs(forward=1.0, backward_input=1.3, backward_weight=0.7, forward_backward=2.5)
    plain = simulate(program, base)
    scaled = simulate(
        program,
        Costs(
            forward=1.0,
            backward_input=1.3,
            backward_weight=0.7,
            forward_backward=2.5,
            microbatch_weights=[1.75] * 8,
        ),
    )
    assert [s.action for s in scaled.spans] == [s.action for s in plain.spans]
    for a, b in zip(plain.spans, scaled.spans, strict=True):
        assert (b.start, b.end) == pytest.approx((1.75 * a.start, 1.75 * a.end))
    assert scaled.peak_activations == plain.peak_activations, "memory is not weighted"


def test_weights_of_one_change_nothing() -> None:
    program = build_schedule("zbv", 2, 4)
    costs = Costs(forward=1.0, backward_input=2.0, comm=0.3)
    weighted = Costs(forward=1.0, backward_input=2.0, comm=0.3, microbatch_weights=[1, 1, 1, 1])
    assert simulate(program, weighted).spans == simulate(program, costs).spans


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_one_rank_runs_the_sum_of_its_weighted_micro_batches(name) -> None:
    weights = [0.5, 2.0, 1.25, 3.0]
    costs = Costs(forward=1.0, backward_input=2.0, backward_weight=1.5, microbatch_weights=weights)
    assert simulate(build_schedule(name, 1, 4), costs).makespan == pytest.approx(4.5 * sum(weights))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_i_and_w_have_their_own_weights_in_a_split_or_a_whole_backward(name) -> None:
    # attention has no weights: packed documents weigh F and I (each its own way), not W
    weights, weights_i, weights_w = [0.5, 2.0, 1.25, 3.0], [1.5, 1.0, 2.0, 4.0], [1.0] * 4
    costs = Costs(
        forward=1.0,
        backward_input=2.0,
        backward_weight=1.5,
        microbatch_weights=weights,
        microbatch_weights_i=weights_i,
        microbatch_weights_w=weights_w,
    )
    assert simulate(build_schedule(name, 1, 4), costs).makespan == pytest.approx(
        1.0 * sum(weights) + 2.0 * sum(weights_i) + 1.5 * 4
    )


def test_a_heavy_micro_batch_lengthens_1f1b_as_worked_by_hand() -> None:
    # 1F1B, 2 ranks, 2 micro-batches, F = 1, B = 2; micro-batch 1 weighs 3.
    # rank 0: F0 [0,1]  F1 [1,4]                 B0 [4,6]   B1 [13,19]
    # rank 1:        F0 [1,2]  B0 [2,4]  F1 [4,7]  B1 [7,13]
    program = build_schedule("1f1b", 2, 2)
    t = simulate(program, Costs(forward=1.0, backward_input=1.0, microbatch_weights=[1.0, 3.0]))
    times = {(s.rank, str(s.action)): (s.start, s.end) for s in t.spans}
    assert times == {
        (0, "0F0"): (0, 1),
        (0, "0F1"): (1, 4),
        (0, "0B0"): (4, 6),
        (0, "0B1"): (13, 19),
        (1, "1F0"): (1, 2),
        (1, "1B0"): (2, 4),
        (1, "1F1"): (4, 7),
        (1, "1B1"): (7, 13),
    }
    assert t.makespan == 19
    assert simulate(program, Costs(forward=1.0, backward_input=1.0)).makespan == 9


def test_an_overlapped_pair_weighs_its_parts_by_their_costs() -> None:
    program = build_schedule("dualpipev", 2, 4)
    pairs = [s for s in simulate(program).spans if s.action.parts]
    assert pairs, "dualpipev overlaps forward and backward pairs"
    weights = [1.0, 2.0, 3.0, 4.0]
    t = simulate(program, Costs(forward=1.0, backward_input=2.0, microbatch_weights=weights))
    for span in t.spans:
        if span.action.parts:
            expected = sum(
                (1.0 if p.kind.name == "F" else 3.0) * weights[p.microbatch]
                for p in span.action.parts
            )
            assert span.duration == pytest.approx(expected), span.action


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([1.0, 1.0], "give one per micro-batch \\(4\\)"),
        ([1.0, -1.0, 1.0, 1.0], "microbatch_weights must be one number in"),
        ([], "microbatch_weights must be one number in"),
        ([True, 1.0, 1.0, 1.0], "microbatch_weights must be one number in"),
    ],
)
def test_bad_weights_are_refused(weights, match) -> None:
    with pytest.raises(ValueError, match=match):
        simulate(build_schedule("1f1b", 2, 4), Costs(microbatch_weights=weights))


def test_w_weights_need_the_f_and_i_weights_and_one_per_micro_batch() -> None:
    with pytest.raises(ValueError, match="microbatch_weights_w need microbatch_weights"):
        Costs(microbatch_weights_w=[1.0])
    with pytest.raises(ValueError, match="microbatch_weights_i and"):
        Costs(microbatch_weights_i=[1.0])
    with pytest.raises(ValueError, match="microbatch_weights_w has 3 values"):
        simulate(
            build_schedule("zb-h1", 2, 4),
            Costs(microbatch_weights=[1.0] * 4, microbatch_weights_w=[1.0] * 3),
        )
