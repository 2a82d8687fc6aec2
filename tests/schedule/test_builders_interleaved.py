"""Looped builders: interleaved-1f1b, looped-bfs, interleaved-zb.

Sweeps assert every accepted shape validates (compute-only, and lowered for small shapes) and
every refused one says its legal values; fixed facts pin the unit-cost makespan and peak memory.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.builders.interleaved import (
    backward_table,
    build_interleaved_1f1b,
    build_interleaved_zb,
    build_looped_bfs,
    interleaved_warmup,
    legal_group_sizes,
    one_f_one_b_order,
    resolve_group_size,
    schedule_table,
    zero_bubble_lag,
    zero_bubble_warmup,
)
from pipetrain.schedule.builders.one_f_one_b import build_1f1b
from pipetrain.schedule.lower import lower
from pipetrain.schedule.placement import PlacementKind, looped
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.validate import validate
from pipetrain.sim.simulate import simulate

ranks = st.integers(1, 16)
chunks = st.integers(1, 4)
microbatches = st.integers(1, 64)
SWEEP = settings(max_examples=60, deadline=None)


def is_legal_group(p: int, m: int, g: int) -> bool:
    """Megatron's rule, restated independently of the builder."""
    if m < p:
        return g == m
    return p <= g <= m and (m % g == 0 or m % g >= p)


def check(program: Program, lowered: bool) -> None:
    validate(program)
    if lowered:
        validate(lower(program))


def kinds_per_rank(program: Program) -> list[dict[OpKind, int]]:
    out = []
    for row in program.actions:
        counts: dict[OpKind, int] = {}
        for a in row:
            counts[a.kind] = counts.get(a.kind, 0) + 1
        out.append(counts)
    return out


# --- interleaved-1f1b ------------------------------------------------------------------------


@SWEEP
@given(ranks, chunks, microbatches, st.one_of(st.none(), st.integers(-1, 70)))
def test_interleaved_1f1b_validates_or_names_legal_group_sizes(p, v, m, g):
    if g is not None and not is_legal_group(p, m, g):
        with pytest.raises(ValueError, match="microbatch_group_size in") as info:
            build_interleaved_1f1b(p, m, v, g)
        assert not isinstance(info.value, ScheduleError)
        assert str(legal_group_sizes(p, m)[0]) in str(info.value)
        return
    program = build_interleaved_1f1b(p, m, v, g)
    assert program.name == "interleaved-1f1b"
    assert program.placement == looped(p, v)
    check(program, lowered=p * v * m <= 256)
    for counts in kinds_per_rank(program):
        assert counts == {OpKind.F: m * v, OpKind.B: m * v}


@SWEEP
@given(ranks, microbatches)
def test_legal_group_sizes_match_the_rule_and_default_is_smallest(p, m):
    legal = legal_group_sizes(p, m)
    assert legal == [g for g in range(1, m + 1) if is_legal_group(p, m, g)]
    assert resolve_group_size("x", p, m, None) == legal[0]
    if m >= p and m % p == 0:
        assert legal[0] == p  # Megatron's default


def test_default_group_matches_torch_rounds_rule_where_torch_accepts():
    # torch ScheduleInterleaved1F1B: rounds = max(1, m // p), g = m // rounds, needs m % rounds == 0
    for p in range(1, 17):
        for m in range(1, 129):
            rounds = max(1, m // p)
            if m % rounds == 0:
                assert resolve_group_size("x", p, m, None) == m // rounds, (p, m)


def test_short_last_group_deadlocks_which_is_why_it_is_refused():
    # p = 4, v = 3, m = 5, g = 4: last group of 1 < p. Build the order bypassing the check.
    p, m, v, g = 4, 5, 3, 4
    forward = schedule_table(m, v, g)
    backward = backward_table(forward, v)
    rows = []
    for r in range(p):
        order = one_f_one_b_order(forward, backward, interleaved_warmup(p, r, v, g, m))
        rows.append([Action(OpKind[k], c * p + r, j) for k, (c, j) in order])
    program = build_interleaved_1f1b(p, m, v).with_actions(rows)
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(program)
    with pytest.raises(ValueError, match=r"microbatch_group_size in \{5\}"):
        build_interleaved_1f1b(p, m, v, g)


def test_fewer_microbatches_than_ranks_runs_one_group():
    program = build_interleaved_1f1b(8, 3, 2)
    check(program, lowered=True)
    assert resolve_group_size("x", 8, 3, None) == 3
    with pytest.raises(ValueError, match=r"\{3\}"):
        build_interleaved_1f1b(8, 3, 2, microbatch_group_size=8)


@SWEEP
@given(ranks, microbatches)
def test_one_chunk_is_plain_1f1b(p, m):
    assert build_interleaved_1f1b(p, m, 1).actions == build_1f1b(p, m).actions


def test_schedule_table_is_megatrons():
    # Megatron's docstring example: PP2, group 3, M5, VP2
    table = schedule_table(5, 2, 3)
    assert [j for _, j in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for c, _ in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    # closed form for equal groups: slot k -> chunk (k // g) mod v, micro-batch (k // (g v)) g + k mod g
    m, v, g = 12, 3, 4
    assert schedule_table(m, v, g) == [
        ((k // g) % v, (k // (g * v)) * g + k % g) for k in range(m * v)
    ]
    assert backward_table(schedule_table(m, v, g), v) == [
        (v - 1 - (k // g) % v, (k // (g * v)) * g + k % g) for k in range(m * v)
    ]


def test_unit_cost_makespan_57_and_peaks():
    # docs/schedules.md: p = 4, m = 8, v = 2, chunk F = I = W = 1 (B = 2), no communication: 57.
    timeline = simulate(build_interleaved_1f1b(4, 8, 2))
    assert timeline.makespan == 57
    assert timeline.peak_activations == (11, 9, 7, 5)  # warm-up 2(p - r - 1) + (v - 1) g, + 1


@SWEEP
@given(st.integers(1, 8), chunks, st.integers(1, 8))
def test_makespan_is_work_plus_p_minus_1_chunk_pairs_when_p_divides_m(p, v, rounds):
    # bubble (p - 1)(F + B) / v in whole-stage time = (p - 1)(F + B) in chunk time
    m = p * rounds
    assert simulate(build_interleaved_1f1b(p, m, v)).makespan == 3 * m * v + 3 * (p - 1)


@SWEEP
@given(ranks, chunks, microbatches)
def test_interleaved_peak_is_warmup_plus_one(p, v, m):
    program = build_interleaved_1f1b(p, m, v)
    g = resolve_group_size("x", p, m, None)
    peaks = simulate(program).peak_activations
    assert peaks == tuple(min(interleaved_warmup(p, r, v, g, m) + 1, m * v) for r in range(p))
    assert peaks[0] == max(peaks)


# --- looped-bfs ------------------------------------------------------------------------------


@SWEEP
@given(ranks, chunks, microbatches)
def test_looped_bfs_validates_and_is_breadth_first(p, v, m):
    program = build_looped_bfs(p, m, v)
    assert program.name == "looped-bfs"
    check(program, lowered=p * v * m <= 256)
    for r, row in enumerate(program.actions):
        forwards, backwards = row[: m * v], row[m * v :]
        assert [(a.kind, a.stage, a.microbatch) for a in forwards] == [
            (OpKind.F, c * p + r, j) for c in range(v) for j in range(m)
        ]
        assert [(a.kind, a.stage, a.microbatch) for a in backwards] == [
            (OpKind.B, c * p + r, j) for c in reversed(range(v)) for j in reversed(range(m))
        ]
    assert simulate(program).peak_activations == (m * v,) * p


def test_looped_bfs_unit_cost():
    assert simulate(build_looped_bfs(4, 8, 2)).makespan == 57


# --- interleaved-zb --------------------------------------------------------------------------


@SWEEP
@given(ranks, chunks, microbatches)
def test_interleaved_zb_validates(p, v, m):
    program = build_interleaved_zb(p, m, v)
    assert program.name == "interleaved-zb"
    assert program.placement.kind is (PlacementKind.LOOPED if v > 1 else PlacementKind.ONE_PER_RANK)
    check(program, lowered=p * v * m <= 256)
    for counts in kinds_per_rank(program):
        assert counts == {OpKind.F: m * v, OpKind.I: m * v, OpKind.W: m * v}


@SWEEP
@given(ranks, chunks, microbatches)
def test_interleaved_zb_is_interleaved_order_with_w_lagged_by_rank(p, v, m):
    zb, base = build_interleaved_zb(p, m, v), build_interleaved_1f1b(p, m, v)
    g = resolve_group_size("x", p, m, None)
    for r, row in enumerate(zb.actions):
        warmup = zero_bubble_warmup(p, r, v, g, m)
        lag = zero_bubble_lag(r, v, m, warmup)
        assert lag == r or lag == max(m * v - warmup - 1, 0) < r
        fi = [(a.kind, a.stage, a.microbatch) for a in row if a.kind is not OpKind.W]
        inputs = [(a.stage, a.microbatch) for a in row if a.kind is OpKind.I]
        weights = [(a.stage, a.microbatch) for a in row if a.kind is OpKind.W]
        assert weights == inputs  # Ws in I order
        # the W of the n-th I sits right after the (n + lag)-th I; the last lag Ws close the row
        position = {(a.kind, a.stage, a.microbatch): i for i, a in enumerate(row)}
        for n, key in enumerate(inputs):
            if n + lag < len(inputs):
                later = inputs[n + lag]
                assert position[(OpKind.W, *key)] == position[(OpKind.I, *later)] + 1
            else:
                assert position[(OpKind.W, *key)] >= len(row) - lag
        # F/I order: the zero-bubble warm-up of forwards, then interleaved 1F1B's F/B order
        assert all(k is OpKind.F for k, _, _ in fi[:warmup])
        assert sorted(fi) == sorted(
            (OpKind.I if a.kind is OpKind.B else a.kind, a.stage, a.microbatch)
            for a in base.actions[r]
        )


@SWEEP
@given(st.integers(1, 12), chunks, st.integers(1, 48))
def test_interleaved_zb_memory_and_time_against_interleaved_1f1b(p, v, m):
    zb = simulate(build_interleaved_zb(p, m, v))
    base = simulate(build_interleaved_1f1b(p, m, v))
    g = resolve_group_size("x", p, m, None)
    # exact: warm-up + 1 + lag (the deferred Ws keep their activations), capped at m v ...
    expected = []
    for r in range(p):
        warmup = zero_bubble_warmup(p, r, v, g, m)
        expected.append(min(warmup + 1 + zero_bubble_lag(r, v, m, warmup), m * v))
    assert zb.peak_activations == tuple(expected)
    # ... hence never more than interleaved 1F1B's by more than the deferral depth r
    for r in range(p):
        assert zb.peak_activations[r] <= base.peak_activations[r] + r
    assert zb.makespan <= base.makespan


def test_interleaved_zb_unit_cost():
    timeline = simulate(build_interleaved_zb(4, 8, 2))
    assert timeline.makespan == 51
    assert timeline.peak_activations == (8, 8, 8, 8)  # (v - 1) g + p on every rank


def test_interleaved_zb_with_one_chunk_is_zb_h1():
    zero_bubble = pytest.importorskip("pipetrain.schedule.builders.zero_bubble")
    for p in range(1, 7):
        for m in range(1, 13):
            assert build_interleaved_zb(p, m, 1).actions == zero_bubble.build_zb_h1(p, m).actions


# --- argument checks -------------------------------------------------------------------------


@pytest.mark.parametrize("build", [build_interleaved_1f1b, build_looped_bfs, build_interleaved_zb])
@pytest.mark.parametrize(
    ("p", "m", "v", "name"),
    [(0, 4, 2, "num_ranks"), (4, 0, 2, "num_microbatches"), (4, 4, 0, "stages_per_rank")],
)
def test_non_positive_counts_are_refused_by_name(build, p, m, v, name):
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        build(p, m, v)
