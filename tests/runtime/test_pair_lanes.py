"""Two lanes per F&B pair (``runtime.pair_lanes``): with ``overlap_pairs=True`` a DualPipeV pair's
forward runs on a second thread while its backward runs on the caller, expert parallel's
collectives on one group per direction. Exact in float64 on gloo against unsplit training; the
lanes really overlap; a failure in the lane surfaces on every rank."""

from __future__ import annotations

import pytest
from pair_lanes_cases import overlapping, run_dense
from runtime_harness import launch


def _check_overlap(spans, pairs) -> list:
    """Every pair's forward ran off the main thread, no other forward did; the pairs whose
    spans intersected."""
    off_main, found = overlapping(spans, pairs)
    assert off_main == {(s, j) for (_, s, j), _ in pairs}, (off_main, pairs)
    return found


@pytest.mark.slow
def test_dense_dualpipev_pairs_on_two_lanes_are_exact_and_a_lane_failure_stops_every_rank():
    """2 ranks, 4 stages: both weight-gradient splits exact to 1e-10, the pairs' forwards on the
    lane; then stage 0 raising in its forward lane on rank 0: rank 0 raises the stage error,
    rank 1 hears of it, neither waits out the timeout."""
    results = launch(2, run_dense, timeout=120)
    found = []
    for out in results:
        assert out["failures"] == []
        for defer, spans in out["spans"].items():
            found += _check_overlap(spans, out["pairs"][defer])
    assert found, "no pair's forward and backward ran at the same time"
    first, second = (out["error"] for out in results)
    assert first.startswith("StageError") and "boom in the forward lane" in first, first
    assert "F 0" in first or "0F" in first, first
    assert "rank 0" in second and "boom" in second, second
    assert all(out["seconds"] < 25 for out in results), [out["seconds"] for out in results]
