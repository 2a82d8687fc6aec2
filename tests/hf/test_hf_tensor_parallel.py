"""``pipetrain.hf.parallelize_causal_lm`` under the pipeline: a tiny Llama at (pp=2, tp=2) on gloo,
float64, equal to the unsplit ``transformers`` model (losses, gradients, clipped norm, AdamW)."""

from __future__ import annotations

import pytest
from hf_tp_cases import run_hf_tensor_parallel
from runtime_harness import launch

V_CUT = [2, 2, 1, 2]  # embedding, 4 decoder layers, norm, head over 4 stages
CASES = [
    {"schedule": "1f1b", "stage_layers": [4, 3], "defer": False},
    {"schedule": "zbv", "stage_layers": V_CUT, "defer": True},
    {
        "schedule": "interleaved-1f1b",
        "stage_layers": V_CUT,
        "defer": None,
        "sequence_parallel": True,
    },
    {"schedule": "dualpipev", "stage_layers": V_CUT, "defer": False, "sequence_parallel": True},
    {
        "schedule": "1f1b",
        "stage_layers": [4, 3],
        "sequence_parallel": True,
        "vocab_parallel": False,
    },
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("export"))
    return launch(4, run_hf_tensor_parallel, CASES, out, timeout=400)


@pytest.mark.slow
def test_llama_tp_plan_matches_the_unsplit_model_and_exports_whole_weights(results):
    problems = [f for r in results for f in r["failures"]]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_gpt2_is_refused_naming_the_supported_models(results):
    for r in results:
        assert "supports the Llama family" in r["errors"]["gpt2"], r["errors"]["gpt2"]


@pytest.mark.slow
def test_sequence_parallel_hidden_states_hold_half_the_tokens(results):
    for r in results:
        assert r["wire"] == (8, r["seq"] // 2, 16), r["wire"]
