"""The HF mask benchmark's CPU run: both variants time every round, the stage builds its mask once
a pass by default and once per decoder layer with the cache off, and both compute the same loss."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "runtime" / "hf_masks_gpu.py"


def test_cpu_smoke_times_both_variants_with_the_same_loss(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--preset", "cpu-smoke", "--out", str(tmp_path)])
    runpy.run_path(str(SCRIPT), run_name="__main__")  # in this process: no second torch import
    rows = json.loads((tmp_path / "hf_masks.json").read_text())["rows"]
    assert sorted((r["round"], r["variant"]) for r in rows) == [
        (0, "once"), (0, "per-layer"), (1, "once"), (1, "per-layer")
    ]  # fmt: skip
    builds = {r["variant"]: r["builds_per_pass"] for r in rows}
    assert builds == {"once": 1, "per-layer": 3}  # the smoke preset's three decoder layers
    assert len({r["first_loss"] for r in rows}) == 1
    assert all(r["median_ms"] > 0 for r in rows)
