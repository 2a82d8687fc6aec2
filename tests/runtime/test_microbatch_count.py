"""One ``Pipeline`` steps batches of a different micro-batch count each step
(``runtime.microbatch_counts``): two gloo ranks, float64, every step's loss and gradients equal
to the unsplit model accumulating over the same micro-batches, under 1F1B, ZBV and DualPipeV;
counts the schedule refuses, and ranks given different counts, refused on every rank."""

from __future__ import annotations

import pytest
from microbatch_count_cases import run_counts, run_refusals
from runtime_harness import launch

CASES = [("1f1b", 2), ("zbv", 4), ("dualpipev", 4)]


@pytest.mark.slow
def test_varying_counts_equal_unsplit_accumulation():
    results = launch(2, run_counts, CASES, timeout=240)
    problems = [f for r in results for f in r]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_counts_that_cannot_run_are_refused_on_every_rank():
    for rank, found in enumerate(launch(2, run_refusals)):
        assert len(found) == 2, (rank, found)
        assert found[0].startswith("dualpipev: ") and "micro-batches >= 2" in found[0].replace(
            "microbatches", "micro-batches"
        ), found[0]
        assert "num_microbatches" in found[1] and "4" in found[1] and "8" in found[1], found[1]
