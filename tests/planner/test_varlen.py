"""Length-aware packing of documents into fixed-shape micro-batches (pure Python)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.planner.costs_file import (
    CostsFileError,
    LayerCost,
    ModelCosts,
    load_costs,
    parse_costs,
    save_costs,
)
from pipetrain.planner.varlen import (
    LengthCost,
    StepPack,
    arrange_microbatches,
    fit_length_cost,
    model_length_cost,
    pack_step,
    with_length_costs,
)


@st.composite
def steps(draw: st.DrawFn) -> tuple[list[int], int, int, int, LengthCost]:
    seq_len = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(1, seq_len), max_size=40))
    microbatches = draw(st.integers(1, 6))
    rows = draw(st.integers(1, 3))
    cost = LengthCost(
        per_token=draw(st.sampled_from([0.0, 1.0, 2.5])),
        per_token_sq=draw(st.sampled_from([0.0, 0.01, 1.0])),
    )
    return lengths, microbatches, rows, seq_len, cost


def pack(case: tuple[list[int], int, int, int, LengthCost], balanced: bool) -> StepPack:
    lengths, microbatches, rows, seq_len, cost = case
    return pack_step(
        lengths, microbatches=microbatches, rows=rows, seq_len=seq_len, cost=cost, balanced=balanced
    )


def check_well_formed(result: StepPack, case: tuple[list[int], int, int, int, LengthCost]) -> None:
    lengths, microbatches, rows, seq_len, _ = case
    assert len(result.microbatches) == microbatches
    assert all(len(mb) == rows for mb in result.microbatches)
    packed = [i for mb in result.microbatches for row in mb for i in row]
    assert len(packed) == len(set(packed)), "an index packed twice"
    assert not set(packed) & set(result.left_over)
    assert sorted(packed + list(result.left_over)) == list(range(len(lengths)))
    assert list(result.left_over) == sorted(result.left_over)
    for mb in result.microbatches:
        for row in mb:
            assert sum(lengths[i] for i in row) <= seq_len
            assert list(row) == sorted(row)


@settings(max_examples=300, deadline=None)
@given(steps())
def test_both_packings_are_well_formed_and_deterministic(case) -> None:
    for balanced in (False, True):
        result = pack(case, balanced)
        check_well_formed(result, case)
        assert pack(case, balanced) == result


@settings(max_examples=300, deadline=None)
@given(steps())
def test_balanced_is_never_dearer_and_never_packs_fewer_tokens(case) -> None:
    lengths, _, _, seq_len, cost = case
    fixed, balanced = pack(case, False), pack(case, True)
    assert set(fixed.packed()) <= set(balanced.packed()), "balanced dropped a document fixed took"
    worst_fixed = max(fixed.costs(lengths, cost, padded_to=seq_len))
    worst_balanced = max(balanced.costs(lengths, cost, padded_to=seq_len))
    assert worst_balanced <= worst_fixed + 1e-9 * max(1.0, worst_fixed)


@settings(max_examples=200, deadline=None)
@given(steps())
def test_fixed_packing_is_next_fit_in_order(case) -> None:
    lengths, _, _, seq_len, _ = case
    result = pack(case, False)
    rows = [row for mb in result.microbatches for row in mb]
    flat = [i for row in rows for i in row]
    assert flat == list(range(len(flat))), "fixed packing keeps the given order"
    assert result.left_over == tuple(range(len(flat), len(lengths)))
    used = [row for row in rows if row]
    for row, nxt in pairwise(used):
        assert sum(lengths[i] for i in row) + lengths[nxt[0]] > seq_len, "opened a row too soon"
    if result.left_over:
        assert rows[-1], "left documents over with an empty row"
        assert sum(lengths[i] for i in rows[-1]) + lengths[result.left_over[0]] > seq_len


def test_balanced_spreads_long_documents_that_fixed_packing_bunches() -> None:
    # two long documents first, then short ones: fixed packing puts both long ones in
    # micro-batch 0 (2 rows each), balanced gives each micro-batch one long document
    lengths = [8, 8, 2, 2, 2, 2, 2, 2, 2, 2]
    cost = LengthCost(per_token=1.0, per_token_sq=1.0)
    kw = {"microbatches": 2, "rows": 2, "seq_len": 8, "cost": cost}
    fixed = pack_step(lengths, balanced=False, **kw)
    balanced = pack_step(lengths, balanced=True, **kw)
    assert fixed.microbatches[0] == ((0,), (1,))
    assert fixed.costs(lengths, cost, padded_to=8) == (16 + 128, 16 + 32)
    assert balanced.costs(lengths, cost, padded_to=8) == (16 + 64 + 16, 16 + 64 + 16)
    assert fixed.left_over == balanced.left_over == ()


def test_balanced_fills_gaps_with_later_documents() -> None:
    # fixed packing stops at the 5-token document; a later 1-token one fits the gap
    lengths = [4, 5, 1]
    kw = {"microbatches": 1, "rows": 1, "seq_len": 5, "cost": LengthCost(1.0, 0.0)}
    assert pack_step(lengths, balanced=False, **kw).left_over == (1, 2)
    balanced = pack_step(lengths, balanced=True, **kw)
    assert balanced.microbatches == (((0, 2),),) and balanced.left_over == (1,)


@pytest.mark.parametrize(
    ("lengths", "kw", "match"),
    [
        ([0], {}, "lengths must be integers 1..seq_len=8"),
        ([9], {}, "split longer documents first"),
        ([2], {"microbatches": 0}, "microbatches must be an integer >= 1"),
        ([2], {"rows": 0}, "rows must be an integer >= 1"),
    ],
)
def test_refuses_what_it_cannot_pack(lengths, kw, match) -> None:
    args = {"microbatches": 2, "rows": 1, "seq_len": 8, "cost": LengthCost(), **kw}
    with pytest.raises(ValueError, match=match):
        pack_step(lengths, balanced=True, **args)
    with pytest.raises(ValueError, match="per_token_sq must be a finite number >= 0"):
        LengthCost(1.0, -1.0)


@settings(max_examples=100, deadline=None)
@given(
    st.floats(0.0, 10.0),
    st.floats(0.0, 1e-2),
    st.lists(st.integers(1, 8192), min_size=2, max_size=6, unique=True),
)
def test_a_fit_on_exact_times_recovers_the_coefficients(a, b, lengths) -> None:
    times = [a * n + b * n * n for n in lengths]
    fit = fit_length_cost(lengths, times)
    # least squares minimises absolute residuals: what float64 leaves of each is relative to
    # the largest time, not to the point's own (a small time beside a large one)
    scale = 1.0 + max(times)
    for n, t in zip(lengths, times, strict=True):
        assert fit.of(n) == pytest.approx(t, rel=1e-6, abs=1e-9 * scale)
    assert fit.per_token == pytest.approx(a, rel=1e-5, abs=1e-9 * scale)
    assert fit.per_token_sq == pytest.approx(b, rel=1e-5, abs=1e-12 * scale)


def test_a_fit_holds_a_negative_coefficient_at_zero() -> None:
    # times linear in n with noise that an unconstrained fit reads as a negative n² term
    fit = fit_length_cost([512, 1024, 2048], [1.0, 2.0, 3.9])
    assert fit.per_token_sq == 0.0
    assert fit.per_token == pytest.approx(
        (512 + 2 * 1024 + 3.9 * 2048) / (512**2 + 1024**2 + 2048**2)
    )
    with pytest.raises(ValueError, match="two or more distinct lengths"):
        fit_length_cost([512, 512], [1.0, 1.0])


def test_length_costs_are_written_per_layer_and_summed_for_the_model(tmp_path) -> None:
    def measured(n: int) -> ModelCosts:
        # two rows per micro-batch; layer 0 linear, layer 1 with an attention term
        return ModelCosts(
            layers=(
                LayerCost(
                    name="embed",
                    forward=2e-3 * n,
                    backward_input=None,
                    backward_weight=None,
                    backward=2e-3 * n,
                    activation=1.0,
                    params=1.0,
                ),
                LayerCost(
                    name="block",
                    forward=2 * (1e-3 * n + 1e-6 * n * n),
                    backward_input=None,
                    backward_weight=None,
                    backward=4 * (1e-3 * n + 1e-6 * n * n),
                    activation=1.0,
                    params=1.0,
                ),
            )
        )

    costs = with_length_costs({n: measured(n) for n in (64, 128, 256)}, at=128, rows=2)
    assert costs.layers[0].forward == measured(128).layers[0].forward
    assert costs.layers[0].per_token == pytest.approx(2e-3)
    assert costs.layers[0].per_token_sq == pytest.approx(0.0, abs=1e-12)
    assert costs.layers[1].per_token == pytest.approx(3e-3)
    assert costs.layers[1].per_token_sq == pytest.approx(3e-6)
    whole = model_length_cost(costs)
    assert (whole.per_token, whole.per_token_sq) == pytest.approx((5e-3, 3e-6))
    path = tmp_path / "costs.json"
    save_costs(costs, path)
    assert load_costs(path) == costs
    assert costs.meta["length_cost"] == {"seq_lens": [64, 128, 256], "rows": 2, "at": 128}
    with pytest.raises(ValueError, match="profile with pipetrain profile --seq-lens"):
        model_length_cost(measured(128))
    with pytest.raises(ValueError, match="no costs measured at sequence length 100"):
        with_length_costs({n: measured(n) for n in (64, 128)}, at=100, rows=2)


def test_a_costs_file_gives_per_token_and_per_token_sq_together() -> None:
    layer = {"name": "b", "forward": 1, "backward": 2, "activation": 1, "params": 1}
    with pytest.raises(CostsFileError, match=r"layers\[0\].per_token_sq: missing"):
        parse_costs({"version": 2, "layers": [{**layer, "per_token": 0.1}]})
    with pytest.raises(CostsFileError, match="a version 2 field in a version 1 file"):
        parse_costs({"version": 1, "layers": [{**layer, "per_token": 0.1, "per_token_sq": 0}]})
    old = parse_costs({"version": 2, "layers": [layer]})
    assert old.layers[0].per_token is None


@settings(max_examples=200, deadline=None)
@given(steps(), st.integers(1, 3))
def test_arranging_deals_whole_micro_batches_to_replicas_lightest_first(case, replicas) -> None:
    lengths, microbatches, rows, seq_len, cost = case
    packed = pack_step(
        lengths,
        microbatches=microbatches * replicas,
        rows=rows,
        seq_len=seq_len,
        cost=cost,
        balanced=True,
    )
    arranged = arrange_microbatches(packed, lengths, cost, seq_len=seq_len, replicas=replicas)
    assert sorted(arranged.microbatches) == sorted(packed.microbatches)
    assert arranged.left_over == packed.left_over
    costs = arranged.costs(lengths, cost, padded_to=seq_len)
    groups = [costs[r * microbatches : (r + 1) * microbatches] for r in range(replicas)]
    assert all(list(g) == sorted(g) for g in groups), "each replica lightest first"
    sums = [sum(g) for g in groups]
    # dealt dearest first to the cheapest replica: replicas differ by at most the dearest one
    assert max(sums) - min(sums) <= max(costs) + 1e-9 * max(1.0, max(sums))


def test_arranging_refuses_an_uneven_split() -> None:
    packed = pack_step(
        [3, 3, 3], microbatches=3, rows=1, seq_len=4, cost=LengthCost(), balanced=True
    )
    with pytest.raises(ValueError, match="3 micro-batches do not split evenly over 2 replicas"):
        arrange_microbatches(packed, [3, 3, 3], LengthCost(), seq_len=4, replicas=2)


def test_padded_costs_refuse_a_row_longer_than_the_padding() -> None:
    packed = pack_step([6, 2], microbatches=1, rows=1, seq_len=8, cost=LengthCost(), balanced=False)
    assert packed.costs([6, 2], LengthCost(2.0, 1.0), padded_to=8) == (2.0 * 8 + 36 + 4,)
    with pytest.raises(ValueError, match="a row holds 8 tokens, more than padded_to=4"):
        packed.costs([6, 2], LengthCost(), padded_to=4)
