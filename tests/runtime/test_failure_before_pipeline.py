"""A rank that fails before (or while) building its pipeline reaches its peers within seconds,
with its own cause: the peer's pipeline construction raises naming the rank and its error
instead of waiting out ``timeout`` at its first exchange (which named "tied weights")."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from failure_cases import fail_around_construction
from runtime_harness import launch


@pytest.mark.slow
def test_a_failure_before_the_pipeline_reaches_the_peers_within_seconds() -> None:
    waiting, failing = launch(2, fail_around_construction, timeout=150)
    assert [case for case, _, _ in waiting] == ["before, OSError", "before, ValueError", "inside"]
    for case, said, took in waiting:
        assert took < 10, (case, took, said)  # not the 60 s timeout
        assert "tied weights" not in said and "did not arrive" not in said, said
        assert "rank 1 failed" in said, said
    assert waiting[0][1].startswith("PeerFailedError: "), waiting[0]
    assert "OSError: [Errno 28] No space left on device: '/data/shard-1'" in waiting[0][1]
    # a refusal is a refusal on every rank: PipelineRefused is a ValueError
    assert waiting[1][1].startswith("PipelineRefused: ") and "holds no layer 3" in waiting[1][1]
    assert "stage 1 could not be loaded" in waiting[2][1], waiting[2]
    assert [own for _, own, _ in failing] == [
        "OSError: [Errno 28] No space left on device: '/data/shard-1'",
        "ValueError: shard 1 holds no layer 3",
        "RuntimeError: stage 1 could not be loaded",
    ]
