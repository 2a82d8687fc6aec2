"""Pipeline features on 2 gloo ranks: callable stages, eval_step, timelines, hooks, cleanup."""

from __future__ import annotations

import pytest
from runtime_cases import run_features
from runtime_harness import launch


@pytest.mark.slow
def test_features_on_two_ranks():
    r0, r1 = launch(2, run_features, timeout=90)
    assert r0["local_stages"] == [0, 3] and r1["local_stages"] == [1, 2]  # built only locally
    for r in (r0, r1):
        assert r["exact"] == [True, True, True]
        assert r["activations_alive"] == 0 and r["leftovers"] == 0
        assert r["hook_counts"] == [3], "post-accumulate hooks: once per parameter per step"
        assert r["hook_saw_whole_grad"] == [True, True, True]
        is_timeline, measured, ranks, spans, computes = r["timeline"]
        assert is_timeline and measured and ranks == 2 and spans == computes
    assert r0["eval_close"] is True and r1["eval_close"] is None
