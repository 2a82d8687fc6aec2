"""benchmarks/runtime/checkpoint_stall.py runs end to end on its CPU smoke preset: both kinds of
save measured on the same model, each checkpoint verified, the JSON and the table written."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks.runtime import checkpoint_stall


def test_the_smoke_preset_measures_both_saves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert checkpoint_stall.main(["--preset", "cpu-smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "checkpoint_stall.json").read_text())
    assert result["parameters"] > 0 and result["state_bytes"] > 3 * 4 * result["parameters"] - 1
    for mode in ("sync", "async"):
        rows = result[mode]
        assert [r["save"] for r in rows] == [0, 1] and rows[0]["checked"]
        for r in rows:
            assert r["stall_s"] >= r["call_s"] > 0 and r["steps_during"] >= 1
    assert result["async"][0]["steps_during"] >= 1
    assert result["ratio"] == result["async_stall_s"] / result["sync_stall_s"]
    assert result["target"] is None and result["met"] is None  # no target on the CPU
    assert not (tmp_path / "ckpt").exists()  # every checkpoint removed once measured
    said = capsys.readouterr().out
    assert "| save | mode | call s |" in said and "of the synchronous" in said
