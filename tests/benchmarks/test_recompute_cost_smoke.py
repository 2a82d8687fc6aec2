"""The recompute-cost benchmark's CPU dry run: the unsplit model and the pipeline (1F1B and zbv,
both weight-gradient splits) with no, full and selective recompute on 2 gloo processes at a tiny
shape, every row measured, each recomputing row's first loss equal to its row without recompute,
and the ratios the GPU table reports computed; then recompute on the blocks only, whose pipeline
goes through ``recompute_layers`` instead of a plan; then stages recomputed as a whole, held
against the unsplit model recomputed as a whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: a benchmark's dry run of a minute or more on 2 cores: the stress tier (make test-all)
pytestmark = pytest.mark.stress

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "recompute" / "recompute_cost_gpu.py"


def _dry_run(out: Path, *extra: str) -> dict:
    argv = [sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out),
            "--warmup", "0", "--steps", "1", *extra]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "wrote" in done.stdout
    return json.loads((out / "recompute_cost.json").read_text())


@pytest.mark.slow
def test_cpu_dry_run_measures_every_row_and_recompute_changes_no_loss(tmp_path: Path) -> None:
    report = _dry_run(tmp_path / "all", "--schedules", "1f1b,zbv")
    assert report["mismatches"] == []
    rows = report["rows"]
    assert [r["recompute"] for r in rows if r["kind"] == "unsplit"] == ["none", "full", "selective"]
    pipeline = {
        (r["schedule"], r["split"], r["recompute"]) for r in rows if r["kind"] == "pipeline"
    }
    assert pipeline == {
        (s, split, mode)
        for s in ("1f1b", "zbv")
        for split in ("deferred", "replay")
        for mode in ("none", "full", "selective")
    }
    assert all("step_ms" in r and "error" not in r for r in rows), rows
    assert all(len(r["peak_gib"]) == 2 for r in rows if r["kind"] == "pipeline")
    assert len(report["ratios"]) == 8
    for q in report["ratios"]:
        assert q["quotient"] == pytest.approx(q["ratio_pipe"] / q["ratio_unsplit"])
    blocks = _dry_run(tmp_path / "blocks", "--wrap", "blocks", "--schedules", "zb-h1",
                      "--splits", "replay")  # fmt: skip
    assert blocks["mismatches"] == [] and len(blocks["ratios"]) == 2
    assert all("step_ms" in r for r in blocks["rows"]), blocks["rows"]
    whole = _dry_run(tmp_path / "whole", "--modes", "none,whole", "--schedules", "zbv",
                     "--splits", "deferred")  # fmt: skip
    assert [r["recompute"] for r in whole["rows"] if r["kind"] == "unsplit"] == ["none", "whole"]
    assert whole["mismatches"] == [] and len(whole["ratios"]) == 1
