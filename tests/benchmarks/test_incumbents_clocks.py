"""incumbents_clocks.py: each row gets the SM clock samples taken while its timed steps ran (else
between the row's start and end, said so), per GPU; rows without samples or stamps say so rather
than borrow another row's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.incumbents.incumbents_clocks import report


def test_rows_get_the_samples_taken_while_they_ran(tmp_path: Path) -> None:
    part = tmp_path / "e1-gpt16-l0"
    part.mkdir()
    base = {"shape": "gpt", "schedule": "1f1b", "microbatches": 16}
    rows = [
        base | {"lib": "megatron", "median_ms": 370.0, "allocator_retries": [0, 2],
                "started": "2026/11/28 05:00:00.000", "ended": "2026/11/28 05:00:10.000"},
        base | {"lib": "pipetrain-nodefer", "median_ms": 372.0,
                "started": "2026/11/28 05:00:10.500", "ended": "2026/11/28 05:00:20.000",
                "timed_from": "2026/11/28 05:00:14.000", "timed_to": "2026/11/28 05:00:16.000"},
        base | {"lib": "torch", "median_ms": 380.0},  # an old file: no stamps
        # stamped before the timed steps were: the 2 s of its steps before its end
        base | {"lib": "megatron-v2", "median_ms": 1000.0, "all_ms": [1000.0, 1000.0],
                "started": "2026/11/28 05:00:20.500", "ended": "2026/11/28 05:00:30.000"},
        base | {"lib": "deepspeed", "error": "OOM"},
    ]  # fmt: skip
    (part / "incumbents.json").write_text(json.dumps({"rows": rows}))
    (tmp_path / "e1-gpt16-l0.smi.csv").write_text(
        "2026/11/28 05:00:01.000, 0, 1980, 650.5, 60\n"
        "2026/11/28 05:00:01.000, 1, 1960, 640.0, 61\n"
        "2026/11/28 05:00:05.000, 0, 1940, 690.5, 63\n"
        "2026/11/28 05:00:15.000, 0, 1800, 700, 70\n"
        "2026/11/28 05:00:11.000, 0, 345, 80, 50\n"  # the next row's set-up: idle
        "2026/11/28 05:00:15.000, 1, 1820, 700, 71\n"
        "2026/11/28 05:00:21.000, 0, 345, 90, 50\n"  # its set-up
        "2026/11/28 05:00:29.000, 0, 1700, 690, 66\n"
        "[N/A], 0, garbage\n"
    )
    text = report(tmp_path)
    assert (
        "| e1-gpt16-l0 | gpt 1f1b n=16 megatron | 370.0 | whole row | 1960 / 1960 | 670 / 640 "
        "| 63 | 0/2 |" in text
    )
    assert (
        "| gpt 1f1b n=16 pipetrain-nodefer | 372.0 | timed steps | 1800 / 1820 | 700 / 700 | 71 "
        "| - |" in text
    )
    assert "| gpt 1f1b n=16 torch | 380.0 | | no samples | | | - |" in text
    assert "n=16 megatron-v2 | 1000.0 | steps before the end | 1700 | 690 | 66 | - |" in text
    assert "deepspeed" not in text
    assert "| gpt 1f1b n=16 megatron | 1 | 1960 | 655 |" in text
    assert "| gpt 1f1b n=16 pipetrain-nodefer | 1 | 1810 | 700 |" in text
