"""Tensor parallel inside the stages: torch's ``parallelize_module`` plans on ``mesh["tp"]`` of
one DeviceMesh with the pipeline, float64 on gloo against the model unsplit and unparallelized:
losses, every gradient, the clipped norm (each tp shard, stage and replica counted once) and
the parameters after two AdamW steps."""

from __future__ import annotations

import pytest
from runtime_harness import launch
from tp_cases import run_3d, run_tensor_parallel, save_at_pp2_tp2_and_load_at_pp4_and_unsplit

V_CUT = [2, 1, 1, 2]  # embed + 4 blocks + head over 4 stages
CASES = [
    {"schedule": "1f1b", "stage_layers": [3, 3], "defer": False},
    {"schedule": "1f1b", "stage_layers": [3, 3], "defer": True, "loss": "token_mean"},
    {"schedule": "interleaved-1f1b", "stage_layers": V_CUT, "defer": None},
    {"schedule": "zbv", "stage_layers": V_CUT, "defer": False},
    {"schedule": "zbv", "stage_layers": V_CUT, "defer": True},
    {"schedule": "dualpipev", "stage_layers": V_CUT, "defer": False},
    {"schedule": "dualpipev", "stage_layers": V_CUT, "defer": True, "loss": "token_mean"},
    # sequence parallel: activations travel sharded along the sequence between stages
    {"schedule": "zbv", "stage_layers": V_CUT, "defer": True, "sequence_parallel": True},
    {"schedule": "1f1b", "stage_layers": [3, 3], "defer": False, "sequence_parallel": True},
]


@pytest.fixture(scope="module")
def results():
    return launch(4, run_tensor_parallel, (2, 2), ("pp", "tp"), CASES, timeout=400)


@pytest.mark.slow
def test_pp2_tp2_matches_the_unparallelized_model(results):
    problems = [f for r in results for f in r["failures"]]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_what_cannot_be_counted_once_is_refused_on_every_rank(results):
    for r in results:
        e = r["errors"]
        assert "mesh dimension 'cp' is not supported" in e["cp"], e["cp"]
        assert "pass the DeviceMesh it lives on as Pipeline(mesh=...)" in e["group_with_dtensors"]
        assert "needs a 'dp'" in e["ddp_without_dp"], e["ddp_without_dp"]


FSDP_CASES = [
    {"schedule": "1f1b", "stage_layers": [3, 3], "defer": False, "data_parallel": "fsdp"},
    {
        "schedule": "zbv",
        "stage_layers": V_CUT,
        "defer": True,
        "data_parallel": "fsdp",
        "loss": "token_mean",
    },
]


@pytest.mark.slow
def test_dp2_pp2_tp2_fsdp2_and_checkpoints_resharded_across_tp_pp_and_unsplit(tmp_path):
    """Saved at (pp=2, tp=2); loaded at pp=4, unsplit, and (in the 8-process launch, after
    training there under FSDP2) at (dp=2, pp=2, tp=2)."""
    path = str(tmp_path / "ckpt")
    failures = launch(4, save_at_pp2_tp2_and_load_at_pp4_and_unsplit, path, timeout=300)
    assert not [f for r in failures for f in r], failures
    results = launch(8, run_3d, FSDP_CASES, path, timeout=600)
    problems = [f for r in results for f in r]
    assert not problems, "\n".join(problems)
