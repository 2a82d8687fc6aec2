"""The simulator against the published results (docs/schedules.md, ZB paper Table 2)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate

P, M = 4, 8


@pytest.mark.parametrize(
    ("name", "makespan", "span", "peaks"),
    [
        ("gpipe", 33, 33, (8, 8, 8, 8)),
        ("1f1b", 33, 33, (4, 3, 2, 1)),
        ("zb-h1", 27, 27, (4, 4, 4, 4)),
        ("zb-h2", 27, 24, (7, 7, 7, 7)),
    ],
)
def test_unit_cost_facts(name, makespan, span, peaks) -> None:
    t = simulate(build_schedule(name, P, M))
    assert t.makespan == makespan
    assert t.span == span
    assert t.peak_activations == peaks


def test_interleaved_unit_fact() -> None:
    # p = 4, m = 8, v = 2 with chunk costs F = I = W = 1: 57 chunk-units
    assert simulate(build_schedule("interleaved-1f1b", 4, 8, 2)).makespan == 57


def test_zbv_has_no_steady_state_bubble_and_balanced_memory() -> None:
    t = simulate(build_schedule("zbv", P, M))
    assert t.span == 2 * M * 3  # two chunks × m micro-batches × (F + I + W)
    assert t.peak_activations == (2 * P,) * P


@pytest.mark.parametrize("costs", [(1, 1, 1), (2, 1.5, 1), (3, 2, 1), (1.2, 1.1, 0.9), (1, 1, 0.5)])
@pytest.mark.parametrize(("p", "m"), [(4, 8), (4, 12), (6, 24), (8, 16)])
def test_zb_table_2_closed_forms(costs, p, m) -> None:
    """Qi et al. 2024 Table 2: bubble = max rank span − m(F + I + W)."""
    f, i, w = costs
    c = Costs(forward=f, backward_input=i, backward_weight=w)
    expected = {
        "1f1b": (p - 1) * (f + i + w),
        "zb-h1": (p - 1) * (f + i - w),
        "zb-h2": max(0.0, (p - 1) * (f + i - 2 * w)),
    }
    for name, bubble in expected.items():
        t = simulate(build_schedule(name, p, m), c)
        assert t.span - m * (f + i + w) == pytest.approx(bubble), name


def test_communication_is_paid_only_across_ranks() -> None:
    # one micro-batch down and back: 2(p - 1) crossings, the last stage's F→B turn is free
    c = 0.5
    t = simulate(build_schedule("1f1b", P, 1), Costs(comm=c))
    assert t.makespan == pytest.approx(P * 3 + 2 * (P - 1) * c)
    # in steady state 1F1B pays a round trip per micro-batch on rank 0, so it grows faster
    assert simulate(build_schedule("1f1b", P, M), Costs(comm=c)).makespan > 33 + 2 * (P - 1) * c
    # one rank: nothing crosses
    assert simulate(build_schedule("1f1b", 1, M), Costs(comm=10)).makespan == 2 * M + M


def test_v_turn_costs_no_communication() -> None:
    # zbv's last stage and the stage before it share a rank; only cross-rank hops pay
    base = simulate(build_schedule("zbv", 2, 4))
    slow = simulate(build_schedule("zbv", 2, 4), Costs(comm=1))
    assert slow.makespan > base.makespan
    one_rank = simulate(build_schedule("zbv", 1, 4), Costs(comm=100))
    assert one_rank.makespan == 2 * 4 * 3


def test_per_stage_costs_and_activation_sizes() -> None:
    costs = Costs(forward=[1, 2], backward_input=[1, 2], backward_weight=[1, 2], activation=[3, 1])
    t = simulate(build_schedule("1f1b", 2, 4), costs)
    assert t.busy == (4 * 3, 4 * 6)
    assert t.peak_activations == (2 * 3, 1 * 1)


def test_overlapped_pair_cost_default_and_explicit() -> None:
    program = build_schedule("dualpipev", 2, 4)
    t_default = simulate(program)
    t_fast = simulate(program, Costs(forward_backward=2))  # a perfect overlap hides the forward
    assert t_fast.makespan < t_default.makespan
    assert sum(t_default.busy) == 2 * 2 * 4 * 3  # ranks × stages/rank × m × (F + I + W)


@pytest.mark.parametrize(
    "bad",
    [
        {"forward": -1},
        {"backward_input": math.nan},
        {"comm": math.inf},
        {"forward": [1, 2, 3]},
    ],
)
def test_bad_costs_name_the_problem(bad) -> None:
    with pytest.raises(ValueError, match="cost (forward|backward_input|comm)"):
        simulate(build_schedule("1f1b", 2, 2), Costs(**bad))


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "zbv"]),
    p=st.integers(1, 6),
    m=st.integers(1, 24),
    f=st.floats(0.1, 3),
    i=st.floats(0.1, 3),
    w=st.floats(0.1, 3),
    c=st.floats(0, 1),
)
def test_makespan_never_below_the_busiest_rank(name, p, m, f, i, w, c) -> None:
    try:
        program = build_schedule(name, p, m)
    except ValueError:
        return
    t = simulate(program, Costs(forward=f, backward_input=i, backward_weight=w, comm=c))
    assert t.makespan >= max(t.busy) - 1e-9
    assert 0 <= t.bubble_fraction < 1
    assert len(t.spans) == sum(len(r) for r in program.actions)


def test_activation_held_between_input_and_weight_gradients() -> None:
    """ZB-H1 on one rank-pair: what W still needs can differ from the full activation."""
    program = build_schedule("zb-h1", 2, 4)
    same = simulate(program)
    heavier = simulate(program, Costs(activation_for_weight=1.5))
    lighter = simulate(program, Costs(activation_for_weight=0.25))
    assert same.peak_activations == (2, 2)
    assert heavier.peak_activations[0] > same.peak_activations[0]
    # the last rank defers W by one micro-batch: its second F overlaps a lightened first one
    assert lighter.peak_activations[1] == 1.25 < same.peak_activations[1]
    assert lighter.peak_activations[0] == same.peak_activations[0]  # rank 0 peaks before any I
    # unsplit backwards never look at it
    gp = build_schedule("1f1b", 2, 4)
    assert (
        simulate(gp, Costs(activation_for_weight=9)).peak_activations
        == simulate(gp).peak_activations
    )
    # the curve always returns to zero
    assert all(curve[-1][1] == 0 for curve in heavier.memory)


def test_workspace_counts_only_while_an_action_runs() -> None:
    """A stage's workspace rides on top of what is held, during that stage's actions alone."""
    program = build_schedule("1f1b", 2, 4)
    base = simulate(program)
    both = simulate(program, Costs(workspace=0.5))
    last = simulate(program, Costs(workspace=[0.0, 0.75]))
    first = simulate(program, Costs(workspace=[0.75, 0.0]))
    # the peak is reached as an F starts, so its workspace adds to it
    assert both.peak_activations == tuple(p + 0.5 for p in base.peak_activations)
    assert last.peak_activations == (base.peak_activations[0], base.peak_activations[1] + 0.75)
    assert all(curve[-1][1] == 0 for curve in both.memory)  # freed when each action ends

    def held(tl, rank, t):
        return [h for time, h in tl.memory[rank] if time <= t][-1]

    # rank 0 idles from the end of its second F (t=2) until the first B arrives (t=4)
    assert held(first, 0, 3.0) == held(base, 0, 3.0) == 2
    assert held(first, 0, 1.5) == held(base, 0, 1.5) + 0.75  # during its second F
    assert base.makespan == both.makespan  # memory only: times are untouched
    with pytest.raises(ValueError, match="workspace"):
        Costs(workspace=-1).per_stage(2)


def test_a_weight_piece_uses_its_own_workspace() -> None:
    """``W`` holds only what it still needs, beside which a stage's whole largest temporary can
    come (``weight_workspace``); ``F``, ``B`` and ``I`` use ``workspace``."""
    program = build_schedule("zb-h1", 2, 2)
    base = dict(activation=1.0, activation_for_weight=0.25, workspace=0.5)
    same = simulate(program, Costs(**base)).peak_activations
    more = simulate(program, Costs(**base, weight_workspace=8.0)).peak_activations
    assert all(m > s for m, s in zip(more, same))
    # the peak comes in a W: at least what that W still needs (0.25) beside its 8
    assert max(more) >= 8.25 and max(more) < max(same) + 8.0
    assert simulate(program, Costs(**base, weight_workspace=0.5)).peak_activations == same
