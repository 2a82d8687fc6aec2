"""Losses of every reduction, tied weights and clipping: float64 on gloo, against unsplit training.

One launch per world size runs every case (process start dominates the time)."""

from __future__ import annotations

import pytest
from runtime_harness import launch
from training_cases import run_losses_tied_clipping

# (schedule, loss reduction, defer_weight_grads, attention mask as a side input)
CASES = {
    2: [
        ("gpipe", "sum", None, False),
        ("1f1b", "token_mean", None, True),
        ("interleaved-1f1b", "token_mean", False, True),
        ("zb-h1", "token_mean", True, False),
        ("zbv", "token_mean", False, True),
        ("zbv", "sum", True, False),
        ("dualpipev", "token_mean", None, True),
    ],
    4: [
        ("1f1b", "token_mean", None, False),
        ("interleaved-zb", "sum", False, True),
        ("zbv", "token_mean", True, True),
        ("dualpipev", "token_mean", False, False),
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_losses_tied_weights_and_clipping_match_unsplit_training(world):
    failures = launch(world, run_losses_tied_clipping, CASES[world], timeout=240)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)
