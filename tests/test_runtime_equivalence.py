"""Every schedule, ranks 1/2/4, float64 on gloo: loss and gradients equal unsplit training."""

from __future__ import annotations

import pytest
from runtime_cases import run_equivalence
from runtime_harness import launch

from pipetrain.schedule.registry import FAMILIES

# dualpipe holds two copies of the model; the runtime refuses it (test_runtime_errors)
NAMES = [str(n) for n in FAMILIES if n != "dualpipe"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_schedule_matches_unsplit_training(world):
    failures = launch(world, run_equivalence, NAMES, timeout=150)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)
