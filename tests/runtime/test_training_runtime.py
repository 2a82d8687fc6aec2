"""Training features on gloo in float64, against the unsplit model: losses of every reduction,
tied weights, clipping, side inputs, activation checkpointing, checkpoints that reshard (with
data parallel too: FSDP2's shards and DDP's replicas, ``fsdp_checkpoint_cases``).

Process start dominates, so one launch per world size runs every case (module fixtures) and the
tests below read its results."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_harness import launch
from training_cases import run_four_ranks, run_two_ranks

# (schedule, loss reduction, defer_weight_grads, attention mask as a side input, tie declared by
# name rather than one Parameter object in both layers): every runnable schedule at 2 and 4 ranks
CASES = {
    2: [
        ("gpipe", "sum", None, False, False),
        ("1f1b", "token_mean", None, True, True),
        ("interleaved-1f1b", "token_mean", False, True, False),
        ("looped-bfs", "sum", None, False, False),
        ("zb-h1", "token_mean", True, False, False),
        ("zb-h2", "token_mean", False, True, False),
        ("interleaved-zb", "token_mean", None, False, False),
        ("zbv", "token_mean", False, True, False),
        ("zbv", "sum", True, False, True),
        ("dualpipev", "token_mean", None, True, False),
    ],
    4: [
        ("gpipe", "token_mean", None, True, False),
        ("1f1b", "token_mean", None, False, False),
        ("interleaved-1f1b", "sum", None, False, True),
        ("looped-bfs", "token_mean", False, True, False),
        ("zb-h1", "sum", False, True, False),
        ("zb-h2", "token_mean", True, False, False),
        ("interleaved-zb", "sum", False, True, False),
        ("zbv", "token_mean", True, True, False),
        ("dualpipev", "token_mean", False, False, True),
    ],
}


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, run_two_ranks, CASES[2], timeout=300)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("training") / "ckpt")
    return launch(4, run_four_ranks, CASES[4], path, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_losses_tied_weights_clipping_and_side_inputs_match_unsplit_training(world, request):
    results = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    problems = [f for r in results for f in r["exact"]]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_bad_training_input_is_refused_on_every_rank_and_eval_takes_side_inputs(two_ranks):
    r0, r1 = (r["refusals"] for r in two_ranks)
    assert r0 == {**r1, "eval_close": r0["eval_close"]}, "every rank refuses alike"
    assert "PipelineRefused" in r0["reduction"] and "mean, sum, token_mean" in r0["reduction"]
    assert "'nope.weight' is not a parameter of any stage" in r0["tied_name"]
    assert "'attn_mask' is taken by no stage" in r0["side_name"]
    assert "attention_mask" in r0["side_name"]
    assert "'attention_mask' requires a gradient" in r0["side_grad"]
    assert "no token is counted" in r0["no_tokens"]
    assert r0["eval_close"] is None and r1["eval_close"] is True


@pytest.mark.slow
def test_one_parameter_in_two_hand_cut_stages_on_one_rank_is_tied(two_ranks):
    for r in two_ranks:
        assert r["hand_cut_tie"] == {"exact": True, "hook_counts": [2], "whole": True}


@pytest.mark.slow
def test_activation_checkpointing_is_exact_and_reentrant_is_refused(two_ranks):
    r0, r1 = (r["activation_checkpointing"] for r in two_ranks)
    for r in (r0, r1):
        assert all(ok for _, _, ok in r["exact"]), r["exact"]
    # forward runs per micro-batch of a checkpointed block: the forward and one recomputation
    # where one backward call covers it (B, or I with deferred weight gradients); graph
    # replay's W recomputes again (docs/training.md)
    assert r0["runs"]["1f1b defer=False"] == 2.0 and r1["runs"]["zbv defer=True"] == 2.0
    assert r1["runs"]["zbv defer=False"] == 3.0
    # the same type on every rank, a ValueError as docs/training.md says
    assert (
        r0["reentrant"].startswith("PipelineRefused") and "use_reentrant=False" in r0["reentrant"]
    )
    assert r1["reentrant"].startswith("PipelineRefused") and "rank 0 failed" in r1["reentrant"]


# How far a continuation on another layout (pipeline size, cut, schedule, data-parallel wrapper,
# the plain model) may end from the uninterrupted run, per element in float64. Another layout may
# accumulate a linear's weight gradient inside the GEMM (deferred stages' ``addmm_``) where the
# uninterrupted run adds it after the GEMM (graph replay, plain autograd), or the other way; on
# some CPUs' BLAS the two round differently, and two steps spread that round-off to every layer.
# Two AdamW steps move every parameter by about the learning rate, so a checkpoint read wrongly
# (or not at all) is many orders of magnitude past this.
ACROSS_LAYOUTS = 1e-12


def _union(parts) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for part in parts:
        out.update(part)
    return out


def _bitwise_differ(run: dict, reference: dict) -> list[str]:
    return [n for n in run if not np.array_equal(run[n], reference[n])]


def _far_from(run: dict, reference: dict) -> dict[str, float]:
    """The names whose largest difference from ``reference`` is past ``ACROSS_LAYOUTS``."""
    gaps = {n: float(np.abs(run[n] - reference[n]).max()) for n in run}
    return {n: gap for n, gap in gaps.items() if not gap <= ACROSS_LAYOUTS}


@pytest.mark.slow
def test_checkpoint_written_at_pp2_continues_bit_for_bit_at_pp2_and_to_round_off_at_pp4_and_pp1(
    four_ranks,
):
    """The same layout (pp=2, zbv, the same cut) continues bit for bit; pp=4 (1F1B, another
    cut) and the plain model continue within ``ACROSS_LAYOUTS`` of the uninterrupted run."""
    results = [r["checkpoints"] for r in four_ranks]
    uninterrupted = _union(r["uninterrupted"] for r in results[:2])
    assert len(uninterrupted) == 10  # embed, 4 × (weight, bias), head: the parts make the model
    saved = _union(r["saved"] for r in results[:2])
    for n, value in uninterrupted.items():  # the tolerance is far below what the steps change
        assert np.abs(value - saved[n]).max() > 1e6 * ACROSS_LAYOUTS, n
    same = _union(r["same_layout"] for r in results[2:])
    assert sorted(same) == sorted(uninterrupted)
    differ = _bitwise_differ(same, uninterrupted)
    assert not differ, f"same layout: {differ} differ from the uninterrupted run"
    others = {"pp=4": _union(r["pp4"] for r in results), "pp=1": results[0]["pp1"]}
    for what, final in others.items():
        assert sorted(final) == sorted(uninterrupted), what
        far = _far_from(final, uninterrupted)
        assert not far, f"{what}: {far} past {ACROSS_LAYOUTS} from the uninterrupted run"
    errors = results[0]["errors"]
    assert "KeyError" in errors["missing_layer"]
    assert "'model.blocks.4.lin.weight'" in errors["missing_layer"]
    assert "first missing key" in errors["missing_layer"]
    assert "'model.0.weight'" in errors["other_model"]
    assert "'blocks.4.lin.weight'" in errors["state_dict"]


@pytest.mark.slow
def test_fsdp2_checkpoint_continues_under_fsdp2_ddp_other_meshes_and_the_plain_model(four_ranks):
    results = [r["data_parallel_checkpoints"] for r in four_ranks]
    assert all(r["sharded"] and r["placed"] for r in results)  # DTensors, state placed alike
    uninterrupted = _union(r["uninterrupted"] for r in results[:2])
    other_replica = _union(r["uninterrupted"] for r in results[2:])
    assert all(np.array_equal(v, other_replica[n]) for n, v in uninterrupted.items())
    assert len(uninterrupted) == 10
    # the same layout (FSDP2, zbv, the same cut): bit for bit (the replicas' sums are a + b);
    # DDP with another schedule and cut, FSDP2 from DDP's checkpoint and the plain model run
    # other layouts: within ACROSS_LAYOUTS
    for rank, r in enumerate(results):
        assert r["fsdp"].keys() <= uninterrupted.keys() and len(r["fsdp"]) >= 4, rank
        differ = _bitwise_differ(r["fsdp"], uninterrupted)
        assert not differ, f"fsdp (mesh rank {rank}): {differ} differ from the uninterrupted run"
    runs = {
        f"{what} (mesh rank {rank})": r[what]
        for what in ("ddp", "fsdp_from_ddp")
        for rank, r in enumerate(results)
    }
    runs |= {"plain": results[0]["plain"]}
    for what, part in runs.items():
        assert part.keys() <= uninterrupted.keys() and len(part) >= 4, what
        far = _far_from(part, uninterrupted)
        assert not far, f"{what}: {far} past {ACROSS_LAYOUTS} from the uninterrupted run"
    assert sorted(results[0]["plain"]) == sorted(uninterrupted)
    for r in results:  # Pipeline.load_state_dict puts whole tensors into the shards
        assert all(np.array_equal(v, r["saved"][n]) for n, v in r["state_dict_loaded"].items())
        # whole on every replica, written by its owners under both names; FSDP2 and DDP at the
        # same cut and schedule run the same backward, so both continue bit for bit
        tied = r["tied"]
        assert {"embed.weight", "head.weight"} & tied["uninterrupted"].keys()
        for kind in ("fsdp", "ddp"):
            assert tied[kind].keys() == tied["uninterrupted"].keys()
            for n, value in tied[kind].items():
                assert np.array_equal(value, tied["uninterrupted"][n]), (kind, n)
    # dp=4, pp=1: the checkpoint's values are read exactly into quarter shards; two steps on
    # other rows per replica sum in another order, so they agree to float64 round-off only
    saved = _union(r["saved"] for r in results[:2])
    for r in results:
        assert sorted(r["quarters_loaded"]) == sorted(saved)
        assert all(np.array_equal(r["quarters_loaded"][n], saved[n]) for n in saved)
        for n, value in r["quarters"].items():
            scale = np.abs(uninterrupted[n]).max()
            assert np.abs(value - uninterrupted[n]).max() <= 1e-13 * scale, n
            assert not np.array_equal(uninterrupted[n], saved[n]), n  # the steps changed it
    errors = [r["errors"] for r in results]
    assert errors[1]["missing_on_one_rank"].startswith("KeyError")
    assert "'model.blocks.4.lin.weight'" in errors[1]["missing_on_one_rank"]
    for rank in (0, 2):  # their stages lack nothing: they learn of rank 1's refusal
        assert "rank 1 of the checkpoint's processes refused" in errors[rank]["missing_on_one_rank"]
    for rank in (0, 1):
        assert (
            "must be the whole job, but the job has 4 processes" in errors[rank]["mesh_not_the_job"]
        )


@pytest.mark.slow
def test_pipetrain_train_with_fsdp2_saves_and_resumes_bit_for_bit(four_ranks):
    """``pipetrain train --dp 2 --data-parallel fsdp -p 2 --checkpoint-dir D`` (its loop in
    the 4-rank launch): 4 steps straight against 2 steps and ``--resume`` to step 4."""
    for r in (r["fsdp_train_resume"] for r in four_ranks):
        first_step, tail = r["resumed"]
        assert first_step == 2 and len(tail) == 2
        assert r["first"] + tail == r["straight"]  # float equality
        assert r["sharded"] > 0 and r["differ"] == []
        assert r["saved"] == ["latest", "step-000002", "step-000004"]
