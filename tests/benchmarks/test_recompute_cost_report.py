"""benchmarks/recompute/recompute_cost_report.py pooled over launches: each recomputing pipeline row's
quotient (its ratio to its row without recompute over the unsplit model's ratio for the same
recompute) with an interval, met only where the interval's far end is within the target."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.recompute.recompute_cost_report import TARGET, pooled, pooled_lines

#: (kind, schedule, split, recompute) -> the median step (ms) a launch's steps scatter around
ROWS = {
    ("unsplit", None, None, "none"): 170.0,
    ("unsplit", None, None, "whole"): 221.0,  # 1.30 x
    ("pipeline", "1f1b", "deferred", "none"): 100.0,
    ("pipeline", "1f1b", "deferred", "whole"): 130.0,  # 1.30 x: quotient 1.00
    ("pipeline", "v-min", "deferred", "none"): 100.0,
    ("pipeline", "v-min", "deferred", "whole"): 150.0,  # 1.50 x: quotient 1.15
}


def launch(seed: int, noise: float) -> dict:
    rng = random.Random(seed)
    rows = []
    for (kind, schedule, split, mode), ms in ROWS.items():
        row = {"kind": kind, "recompute": mode,
               "all_ms": [ms * (1 + rng.uniform(-noise, noise)) for _ in range(20)]}  # fmt: skip
        if kind == "pipeline":
            row.update(schedule=schedule, split=split)
        rows.append(row)
    return {"rows": rows}


def test_pooled_quotients_carry_intervals_and_verdicts_from_their_far_end() -> None:
    quiet = pooled([launch(0, 0.005), launch(1, 0.005)])
    by = {q["schedule"]: q for q in quiet}
    assert set(by) == {"1f1b", "v-min"} and all(q["launches"] == 2 for q in quiet)
    assert by["1f1b"]["quotient"] == pytest.approx(1.0, abs=0.01)
    assert by["1f1b"]["low"] <= by["1f1b"]["quotient"] <= by["1f1b"]["high"] <= TARGET
    assert by["1f1b"]["meets"] and not by["v-min"]["meets"]
    assert by["v-min"]["quotient"] == pytest.approx(1.5 / 1.3, abs=0.01)
    # noisy steps widen the interval past the target: undecided, not met
    noisy = {q["schedule"]: q for q in pooled([launch(2, 0.2), launch(3, 0.2)])}
    assert noisy["1f1b"]["high"] > TARGET and not noisy["1f1b"]["meets"]
    text = "\n".join(pooled_lines(quiet))
    assert "| 1f1b | deferred | whole | 1.00" in text and "| yes |" in text
    assert "| v-min | deferred | whole | 1.15" in text and "| no |" in text
    assert "whole: 1 of 2 rows meet 1.03" in text
