"""After a CUDA-graph capture the ranks meet before the first replay (``Agreement.captured``):
only with the peers that capture the same step. Host-side, so gloo processes run it."""

from __future__ import annotations

import pytest
from capture_meeting_cases import meet
from runtime_harness import launch


@pytest.mark.parametrize(
    ("peer_runs", "want"),
    [
        ("capture", r"^met after ([2-9]|1\.[5-9])"),  # waited for the peer's 2 s capture
        ("eager", r"^met after (0|1\.[0-4])"),  # a peer warming up eagerly is not waited for
        ("replay", r"^met after (0|1\.[0-4])"),  # nor one replaying its older graph
        ("fail", r"^PeerFailedError: .*rank 1 failed: ValueError: the step could not be captured"),
    ],
)
def test_the_meeting_after_a_capture_waits_only_for_peers_capturing_the_same_step(peer_runs, want):
    import re

    seen = launch(2, meet, peer_runs, timeout=60)[0]
    assert re.search(want, seen), seen
