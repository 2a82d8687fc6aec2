"""The test tree mirrors the package (``tests/runtime`` tests ``pipetrain/runtime`` …); the
helpers several folders share — per-rank case runners and the multi-process harness — live in
``tests/support`` and are imported by their module names."""

from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import settings

#: the repository root, for tests that read files of the tree
ROOT = Path(__file__).resolve().parent.parent

SUPPORT = str(Path(__file__).resolve().parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

# Hypothesis's per-example deadline measures the machine, not the code: on a loaded 2-core runner
# a fast example can pass it once and miss it on the replay, which fails the test as flaky.
settings.register_profile("no-deadline", deadline=None)
settings.load_profile("no-deadline")
