"""The one-GPU recompute benchmarks on CPU (a tiny model): ``recompute_memory_gpu.py``, every
stage and mode runs (CPU memory is not counted, so only the paths are checked), and
``host_time_gpu.py``, every layer and mode timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_and_mode_runs(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/recompute/recompute_memory_gpu.py"), "--device", "cpu",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "recompute_memory.json").read_text())["rows"]
    modes = [(r["stage"], r["mode"]) for r in rows]
    assert modes == [
        *((0, m) for m in ("none", "full:1", "full", "selective:1", "selective", "whole")),
        *((1, m) for m in ("none", "full:1", "full", "selective:1", "selective", "whole")),
        (1, "selective (loss layer wrapped)"),
    ]


def test_host_times_every_layer_and_mode(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/host/host_time_gpu.py"), "--device", "cpu",
         "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "host_time.json").read_text())["rows"]
    assert [(r["layer"], r["mode"]) for r in rows] == [
        ("embed", "none"), ("embed", "full"), ("embed", "selective"),
        ("block", "none"), ("block", "full"), ("block", "selective"),
        ("head", "none"), ("head", "full"),
    ]  # fmt: skip
    assert all(0 < r["host_f"] <= r["wall_f"] and 0 < r["host_b"] <= r["wall_b"] for r in rows)
