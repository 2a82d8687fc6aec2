"""The GPU offload benchmark's CPU dry run: every variant's code path on 2 gloo processes (a tiny
Llama-shaped stage of 4 layers), offload moving more of rank 0's saved bytes as the fraction
grows and nothing on 1F1B's last stage, and every offloaded run's first step bitwise equal to
the run without offload."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: a benchmark's dry run of a minute or more on 2 cores: the stress tier (make test-all)
pytestmark = pytest.mark.stress

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "offload" / "offload_gpu.py"


@pytest.mark.slow
def test_cpu_dry_run_exercises_every_variant(tmp_path: Path) -> None:
    argv = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(tmp_path),
            "--warmup", "1", "--steps", "1"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "offload_gpu.json").read_text())
    assert report["mismatches"] == []
    rows = {r["variant"]: r for r in report["results"]}
    assert set(rows) == {"none", "offload 0.5", "offload 0.75", "offload 1.0",
                         "recompute full", "recompute selective"}  # fmt: skip
    shares = []
    for label in ("offload 0.5", "offload 0.75", "offload 1.0"):
        moved, saved = rows[label]["offloaded_gib_per_step"], rows[label]["saved_by_offloaded_gib_per_step"]  # fmt: skip
        assert moved[1] == 0 and moved[0] > 0  # 1F1B's last stage keeps everything
        shares.append(moved[0] / saved[0])
    # offloading everything moves most of what is saved: tensors under host_offload.MIN_BYTES
    # (norms' statistics, biases) stay, about a tenth of this small dry run's saved bytes
    assert shares == sorted(shares) and shares[-1] > 0.85
    assert "wrote" in done.stdout
