"""``benchmarks/gpu/recompute_memory_gpu.py --device cpu``: every stage and mode runs (a tiny
model; CPU memory is not counted, so only the paths are checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_stage_and_mode_runs(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/gpu/recompute_memory_gpu.py"), "--device", "cpu",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "recompute_memory.json").read_text())["rows"]
    modes = [(r["stage"], r["mode"]) for r in rows]
    assert modes == [
        *((0, m) for m in ("none", "full:1", "full", "selective:1", "selective")),
        *((1, m) for m in ("none", "full:1", "full", "selective:1", "selective")),
        (1, "selective (loss layer wrapped)"),
    ]
