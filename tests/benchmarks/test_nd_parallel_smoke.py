"""benchmarks/parallel/nd_parallel_gpu.py runs end to end on 4 gloo processes (its cpu-smoke preset,
shrunk further: one decoder layer, two micro-batches, one warm-up and two timed steps): a row for
each of (pp=2, tp=2), pp=4 and tp=4 with positive tokens/s. Mostly process start-up and imports
(torch, transformers) in four processes: about 25–55 s on the 2-core development box."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

#: a benchmark's dry run of a minute or more on 2 cores: the stress tier (make test-all)
pytestmark = pytest.mark.stress

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "parallel" / "nd_parallel_gpu.py"


@pytest.mark.slow
def test_nd_parallel_cpu_smoke_writes_all_three_layouts(tmp_path: Path) -> None:
    out = tmp_path / "nd.json"
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
        str(SCRIPT), "--preset", "cpu-smoke", "--device", "cpu", "--layers", "1",
        "--microbatches", "2", "--warmup", "1", "--steps", "2", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["world"] == 4 and result["meta"]["backend"] == "gloo"
    rows = {r["layout"]: r for r in result["rows"]}
    assert set(rows) == {"pp2-tp2", "pp4", "tp4"}, rows
    for name, (pp, tp) in {"pp2-tp2": (2, 2), "pp4": (4, 1), "tp4": (1, 4)}.items():
        row = rows[name]
        assert "error" not in row and "skipped" not in row, row
        assert (row["pp"], row["tp"]) == (pp, tp)
        # embedding, one decoder layer, norm, head
        assert len(row["stage_layers"]) == pp and sum(row["stage_layers"]) == 4
        assert row["tokens_per_s"] > 0 and row["median_ms"] > 0
        assert len(row["step_ms"]) == 2 and len(row["losses"]) == 2
    assert "| pp2-tp2 | 1f1b |" in done.stdout
