"""Keyed dropout (``runtime.dropout_rng``): float64 with dropout active, every layout — 1F1B on
two cuts, ZBV, DualPipeV, per-layer and whole-stage recompute, two data-parallel replicas —
draws the unsplit model's masks: loss and every gradient equal to the layers run unsplit under
the same keys, on two steps."""

from __future__ import annotations

import pytest
from dropout_rng_cases import PIPELINE_CASES, run_pipelines, run_tensor_parallel
from runtime_harness import launch


@pytest.fixture(scope="module")
def pipelines():
    return launch(2, run_pipelines)


def test_every_layout_draws_the_unsplit_models_masks(pipelines):
    problems = [p for r in pipelines for p in r["problems"]]
    assert not problems, "\n".join(problems)


def test_layouts_agree_on_the_loss_only_when_seeded(pipelines):
    losses = pipelines[0]["losses"]
    unseeded = losses.pop("unseeded 1f1b"), losses.pop("unseeded zbv")
    assert set(losses) == {label for label, *_ in PIPELINE_CASES}
    first = losses["1f1b"]
    for label, got in losses.items():
        assert got == pytest.approx(first, rel=1e-12, abs=0), label
    # without a seed the masks follow each schedule's order: the dropout here is active
    assert unseeded[0] != pytest.approx(unseeded[1], rel=1e-9)


def test_tensor_parallel_replicated_dropout_is_exact_and_sharded_dropout_per_rank():
    results = launch(2, run_tensor_parallel)
    problems = [p for r in results for p in r["problems"]]
    assert not problems, "\n".join(problems)
    for r in results:
        assert r["replicated equal"], "replicated gradients diverged across the tp ranks"
        assert r["shard masks differ"], "both tp ranks drew one mask for different shards"
        assert r["dropped"] > 0
