"""Tied weights handed over as a stage list, on 2 gloo ranks in float64: one ``Parameter`` object
in stages on different ranks is tied (equal to the unsplit model), a frozen tied parameter gets
no gradient and no hook, and a shared object whose name another stage reuses is refused."""

from __future__ import annotations

import pytest
from runtime_harness import launch
from tied_edges_cases import run_tied_edges


@pytest.fixture(scope="module")
def results():
    return launch(2, run_tied_edges, timeout=120)


@pytest.mark.slow
def test_a_parameter_shared_across_ranks_is_tied_and_a_frozen_one_left_alone(results):
    problems = [f for r in results for f in r["failures"]]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_a_shared_object_under_a_reused_name_is_refused_on_every_rank(results):
    for r in results:
        assert "cannot be found by name on every rank" in r["reused_name"], r["reused_name"]
