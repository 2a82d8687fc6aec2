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


@pytest.mark.slow
def test_transfers_split_by_direction_over_two_groups():
    """The NCCL layout (a second group for transfers to lower ranks) on gloo: still exact."""
    names = ["1f1b", "interleaved-zb", "zbv", "dualpipev"]
    failures = launch(4, run_equivalence, names, True, timeout=150)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "lead"), [(2, 1), (4, 0)])
def test_receives_posted_late_match_unsplit_training(world, lead):
    """``Pipeline(receive_lead=...)``: each receive moved to ``lead`` compute actions before its
    reader, over the two groups of the NCCL layout; the first step discovers shapes with the
    receives there (blocking metadata), the second runs as every later one does."""
    names = ["1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"]
    failures = launch(world, run_equivalence, names, True, False, lead, timeout=150)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_deferred_weight_grads_match_unsplit_training(world):
    """``Pipeline(defer_weight_grads=True)``: the model's tied linear, frozen bias and
    parameter-free stage through I/W split by deferred GEMMs, B and overlapped pairs alike."""
    names = ["1f1b", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "dualpipev"]
    failures = launch(world, run_equivalence, names, False, True, timeout=150)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)
