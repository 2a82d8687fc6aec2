"""The MoE compile benchmark's CPU smoke (``benchmarks/moe/moe_compile_gpu.py --preset
cpu-smoke``): a tiny Qwen3-MoE folder trained eager and with ``--compile`` by ``pipetrain train``,
their losses agreeing and each run's tokens per second in the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from benchmarks.moe import moe_compile_gpu

#: two trainings of a minute on 2 cores, one of them compiling: the stress tier (make test-all)
pytestmark = pytest.mark.stress


def test_cpu_smoke_trains_both_runs_alike_and_writes_the_table(tmp_path: Path) -> None:
    assert moe_compile_gpu.main(["--preset", "cpu-smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    steps = moe_compile_gpu.PRESETS["cpu-smoke"]["steps"]
    assert [len(result["losses"][k]) for k in moe_compile_gpu.RUNS] == [steps, steps]
    assert result["ok"] and result["first_step_rel"] <= moe_compile_gpu.FIRST_STEP
    assert result["losses"]["eager"][-1] < result["losses"]["eager"][0]  # it trains
    assert all(result["tok_per_s"][k]["median"] > 0 for k in moe_compile_gpu.RUNS)
    table = (tmp_path / "results.md").read_text()
    assert "| eager |" in table and "| compiled |" in table and ": ok" in table
