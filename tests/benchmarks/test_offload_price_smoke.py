"""The eager offload price benchmark's CPU dry run: the stage runs plain and offloading, with its
OFFLOAD after each forward and RELOAD ahead of each backward, and moves more bytes as the
fraction grows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: a benchmark's dry run of a minute or more on 2 cores: the stress tier (make test-all)
pytestmark = pytest.mark.stress

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "offload" / "offload_price_gpu.py"


def test_cpu_dry_run_moves_more_as_the_fraction_grows(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--preset", "cpu-smoke", "--blocks", "3",
            "--microbatches", "2", "--reps", "1", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    modes = json.loads((tmp_path / "offload_price.json").read_text())["modes"]
    assert list(modes) == ["offload 0", "offload 0.5", "offload 1"]
    assert 0 < modes["offload 0.5"]["moved_gb"] < modes["offload 1"]["moved_gb"]
    assert "excess_per_block_mb" in modes["offload 1"]
