"""The schedule benchmark runs end to end (smoke: one small shape, pipetrain only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "schedule_build.py"


def test_quick_benchmark_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--no-torch", "--repeat", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "| schedule | ranks × micro-batches |" in done.stdout
    cases = json.loads(out.read_text())["cases"]
    assert {c["schedule"] for c in cases} >= {"gpipe", "1f1b", "zbv", "dualpipev"}
    for case in cases:
        assert (case["ranks"], case["microbatches"]) == (8, 64)
        assert set(case["pipetrain"]["phases"]) == {"build", "lower", "validate", "simulate"}
        assert case["torch"] is None
