"""The schedule benchmark runs end to end (smoke: one small shape, pipetrain only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "schedules" / "schedule_build.py"


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


def test_memory_model_predicts_the_saved_gpu_runs_within_ten_percent() -> None:
    """The simulator's memory model (activations + per-action workspace) against the peaks that
    4 × H100 run 3 measured (a copy of its results in tests/fixtures), re-predicted from each
    row's measured action times."""
    bench = ROOT / "benchmarks" / "pipeline"
    run = ROOT / "tests/fixtures/h100x4-2026-11-26-run3"
    runs = [run / r / "gpu_pipeline.json" for r in ("p2", "p4")]
    done = subprocess.run(
        [sys.executable, str(bench / "memory_model_check.py"), *map(str, runs)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=bench,
    )
    rows = [line.split("|") for line in done.stdout.splitlines()[2:]]
    assert len(rows) == 28, done.stdout  # (5 families + 2 replayw rows) × 2 counts × 2 and 4 ranks
    for cells in rows:
        gap_activations, gap_workspace = (float(cells[i].strip().rstrip("%")) for i in (7, 9))
        assert abs(gap_workspace) <= 10.0, cells
        assert abs(gap_workspace) <= abs(gap_activations), cells
