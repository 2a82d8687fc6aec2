"""The contract (docs/runtime.md): ranks that disagree are refused on every rank with one message
naming the field, both values and the ranks; a rank that fails stops every peer within seconds,
naming it; nothing waits for the timeout."""

from __future__ import annotations

import pytest
from runtime_contract_cases import run_contract
from runtime_harness import launch

STOP_WITHIN = 5.0  # seconds a peer may take to stop after a failure


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def outcomes(request):
    world = request.param
    return world, launch(world, run_contract, timeout=150)


def _all(outs, case):
    return [o[case] for o in outs]


def test_disagreeing_ranks_are_refused_on_every_rank_naming_field_values_and_ranks(outcomes):
    world, outs = outcomes
    last = world - 1
    for case, field, a, b in [
        ("microbatches", "num_microbatches", "4", "5"),
        ("schedule", "schedule", "1f1b", "gpipe"),
        ("stage_count", "num_stages", str(world), str(2 * world)),
    ]:
        for text, seconds in _all(outs, case):
            assert text.startswith("RankMismatchError"), (case, text)
            assert f"disagree on {field}" in text, (case, text)
            assert f"rank 0 has {a}" in text and f"rank {last} has {b}" in text, (case, text)
            assert seconds < STOP_WITHIN, (case, seconds)


def test_construction_failing_on_one_rank_stops_the_others_naming_it(outcomes):
    world, outs = outcomes
    for rank, (text, seconds) in enumerate(_all(outs, "construction_fails")):
        if rank == world - 1:
            assert text.startswith("TypeError") and "not an nn.Module" in text
        else:
            assert text.startswith("PeerFailedError"), text
            assert f"rank {world - 1} failed" in text and "building its Pipeline" in text
        assert seconds < STOP_WITHIN, seconds


@pytest.mark.parametrize(
    ("case", "error", "phase", "said"),
    [
        ("no_loss_fn", "PipelineRefused", "checking its arguments", "loss_fn is required"),
        ("plan_cut_fails", "PipelineRefused", "building its stages", "layers"),
    ],
)
def test_a_failure_in_any_construction_phase_reaches_every_rank_naming_that_phase(
    outcomes, case, error, phase, said
):
    """A refusal (a ValueError) is ``PipelineRefused`` on every rank, the peers naming the rank
    and phase it came from."""
    world, outs = outcomes
    for rank, (text, seconds) in enumerate(_all(outs, case)):
        if rank == world - 1:
            assert text.startswith(error) and said in text, text
        else:
            assert text.startswith("PipelineRefused"), text
            assert f"rank {world - 1} failed: building its Pipeline ({phase})" in text, text
            assert said in text and "tied weights" not in text, text
        assert seconds < STOP_WITHIN, (case, seconds)


def test_inputs_of_other_shapes_or_values_are_refused_at_their_first_step(outcomes):
    world, outs = outcomes
    assert all(t == "no error" for t, _ in _all(outs, "ok_step"))
    for text, seconds in _all(outs, "input_shape"):
        assert "RankMismatchError" in text and "disagree on batch size" in text, text
        assert f"rank {world - 1} has 10" in text and seconds < STOP_WITHIN
    for text, seconds in _all(outs, "input_values"):
        assert "RankMismatchError" in text and "input values (fingerprint)" in text, text
        assert seconds < STOP_WITHIN


def _check_failure(outs, case, failing: int, *expected: str):
    for rank, (text, seconds) in enumerate(_all(outs, case)):
        if rank == failing:
            for part in expected:
                assert part in text, (case, text)
        else:
            assert text.startswith("PeerFailedError"), (case, rank, text)
            assert f"rank {failing} failed" in text or f"rank {failing} closed" in text, text
        assert seconds < STOP_WITHIN, (case, rank, seconds)


def test_a_stage_that_raises_is_named_and_its_peers_stop_within_seconds(outcomes):
    _, outs = outcomes
    _check_failure(
        outs,
        "stage_raises",
        1,
        "StageError",
        "stage 1, micro-batch 2, action F",
        "user code failed",
    )
    for text, _ in _all(outs, "after_failure"):
        assert "closed after a failure" in text, text


def test_a_shape_mismatch_names_stage_micro_batch_and_both_shapes(outcomes):
    _, outs = outcomes
    _check_failure(
        outs,
        "shape_mismatch",
        1,
        "StageError",
        "stage 1, micro-batch 0, action F",
        "received activations: (2, 4) float64",
        "in_features=8",
        "mat1 and mat2",
    )


def test_a_loss_that_fails_names_output_and_target_shapes(outcomes):
    world, outs = outcomes
    _check_failure(
        outs, "loss_mismatch", world - 1, "loss_fn failed on stage", "(2, 4) float64", "(2, 3)"
    )


def test_the_group_still_works_after_every_failure(outcomes):
    _, outs = outcomes
    assert all(t == "no error" for t, _ in _all(outs, "healthy"))
