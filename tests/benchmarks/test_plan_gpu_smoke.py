"""benchmarks/planner/plan_gpu.py runs end to end on 2 gloo processes (its cpu-smoke preset, the
memory-bound budget alone, one round): a budget no plan fits without recompute or offload, a pick
that recomputes or offloads, the pick's cut measured with every variant, and a report that
``--resummarize`` rewrites unchanged. About 30 s on the 2-core development box (profiling the
recompute times and planning three searches, then 9 runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: a benchmark's dry run of a minute or more on 2 cores: the stress tier (make test-all)
pytestmark = pytest.mark.stress

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "planner" / "plan_gpu.py"


@pytest.mark.slow
def test_cpu_smoke_plans_and_measures_the_memory_bound_budget(tmp_path: Path) -> None:
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        str(SCRIPT), "--preset", "cpu-smoke", "--budgets", "memory-bound", "--rounds", "1",
        "--max-near", "1", "--calibrate-host", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "round 0 run 1/" in done.stdout  # progress lines, as each run ends
    assert "nothing to calibrate on a CPU" in done.stdout  # the eager host model is a GPU's
    report = json.loads((tmp_path / "plan_gpu.json").read_text())
    (budget,) = report["budgets"]
    assert budget["budget"] == "memory-bound"
    # below every plan without recompute or offload, above full recompute's lowest peak
    low, high = budget["lowest_peak_full_recompute_gib"], budget["lowest_peak_without_extras_gib"]
    assert low < budget["usable_gib"] < high
    pick, *others = budget["runs"]
    assert pick["role"] == "pick" and pick["predicted_fits"]
    assert any(m != "none" for m in pick["recompute"]) or any(pick["offload"])
    # every variant of the pick's cut is a run of its own or the same program as one
    named = {r["role"] for r in others}
    named |= {f"variant: {x}" for r in budget["runs"] for x in r.get("same_as", [])}
    variants = ("recompute none", "selective", "full", "offload 0.5", "offload 1.0",
                "full+offload 1.0")  # fmt: skip
    assert {f"variant: {v}" for v in variants} <= named
    plain = next(r for r in others if r["role"] == "variant: recompute none")
    assert not plain["predicted_fits"] and set(plain["recompute"]) == {"none"}
    for run in budget["runs"]:
        assert run["measured"] and "error" not in run["measured"], run
        assert run["measured"]["step_ms"] > 0 and run["step_ratio"] > 0
    assert budget["regret"] is not None and "regret at most 3%" in budget["checks"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "budget memory-bound" in summary and "variant: full" in summary
    again = [sys.executable, str(SCRIPT), "--out", "-", "--resummarize", str(tmp_path / "plan_gpu.json")]  # fmt: skip
    subprocess.run(again, capture_output=True, text=True, timeout=60, check=True, cwd=ROOT)
    assert (tmp_path / "summary.txt").read_text() == summary
