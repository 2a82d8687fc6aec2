"""benchmarks/data/varlen_balance.py runs end to end on one small shape and reports every packing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "varlen_balance.py"


def test_the_varlen_benchmark_prints_its_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "varlen.json"
    args = ["--steps", "3", "--ranks", "2", "--rows", "2", "--seq-lens", "4096", "--replicas", "2"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "| ranks × replicas | schedule | rows × seq_len |" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    packings = (
        "fixed",
        "fixed, arranged",
        "balanced",
        "balanced, arranged",
        "look-ahead, arranged",
    )
    assert [(r["schedule"], r["packing"]) for r in rows] == [
        (s, p) for s in ("1f1b", "zbv") for p in packings
    ]
    for row in rows:
        assert row["mean_step_time"] > 0 and row["max_over_mean_cost"] >= 1
    fixed, arranged, balanced, both, ahead = rows[:5]
    assert fixed["padding"] == arranged["padding"] == balanced["padding"] == both["padding"]
    assert arranged["max_over_mean_cost"] == fixed["max_over_mean_cost"], "the order alone"
    assert ahead["padding"] <= fixed["padding"]
    assert balanced["max_over_mean_cost"] <= fixed["max_over_mean_cost"] + 1e-12
