"""benchmarks/incumbents/incumbents_report.py: the tables and target verdicts docs/incumbents.md shows,
from a small hand-made result file whose ratios are known."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "incumbents_small.json"


def _report() -> str:
    script = ROOT / "benchmarks" / "incumbents" / "incumbents_report.py"
    done = subprocess.run(
        [sys.executable, str(script), str(FIXTURE)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_ratios_and_verdicts_follow_the_rows() -> None:
    out = _report()
    assert "pipetrain 1f1b / megatron: 0.900 (met)" in out
    assert "pipetrain interleaved-1f1b / megatron: 1.050 (missed)" in out
    # memory: rank 0 above Megatron's by 0.1 GiB
    assert "peak memory pipetrain 1f1b ≤ megatron: missed on ranks [0]" in out
    assert "(largest per-rank difference +0.100 GiB)" in out
    assert "pipetrain best (1f1b) / megatron best (megatron 1f1b): 0.900 (met" in out
    assert "zbv efficiency 0.950 (missed, target 0.97)" in out


def test_variant_rows_get_ratios_and_skipped_rows_say_why() -> None:
    out = _report()
    row = next(line for line in out.splitlines() if "| pipetrain-leadnone |" in line)
    assert "| 1.100 |" in row  # 110 ms over Megatron's 100 ms, same schedule
    assert "| dualpipev | pipetrain | time budget |" in out
