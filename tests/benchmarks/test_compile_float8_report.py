"""benchmarks/runtime/compile_float8_report.py: the compile and float8 targets read from the
benchmark's rows — each ratio under the pipeline over the same ratio unsplit, pooled over
launches, and the first step against the unsplit model's."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.runtime.compile_float8_report import main, read_rows, report


def row(part, variant, launch, step_s, first_s, schedule=None):
    # steps a little apart, so the bootstrap has something to resample
    times = [step_s * (1 + 0.001 * (i % 3 - 1)) for i in range(9)]
    return {"part": part, "preset": "h2048", "schedule": schedule, "variant": variant,
            "launch": launch, "times": times, "first_s": first_s}  # fmt: skip


def rows(pipe_compile: float) -> list[dict]:
    out = []
    for launch in range(3):
        out += [
            row("unsplit", "eager", launch, 0.200, 1.0),
            row("unsplit", "compile", launch, 0.180, 8.0),
        ]
        out += [row("unsplit", "compile+float8", launch, 0.160, 10.0)]
        for name, t, first in (("eager", 0.100, 1.0), ("compile", pipe_compile, 9.0),
                               ("compile+float8", pipe_compile * 0.9, 20.0)):  # fmt: skip
            out.append(row("pipeline", f"{name}/defer-off", launch, t, first, schedule="zbv"))
    return out


def test_quotients_and_first_steps_against_their_targets(tmp_path) -> None:
    # compile buys the pipeline 5% where it buys the unsplit model 10%: 0.95 / 0.9 = 1.056
    text = report(rows(0.095))
    compile_line, float8_line = [x for x in text.splitlines() if "| zbv |" in x]
    assert "| defer-off | compile / eager | 0.950 | 0.900 | 1.056 [" in compile_line
    assert "| missed |" in compile_line and "1.12 (9.0 / 8.0 s) | met |" in compile_line
    # float8 / compile: 0.9 both ways (quotient 1.000, met); first step 20 / 10 s (missed)
    assert (
        "| 0.900 | 0.889 | 1.012 [" in float8_line
        and "| met | 2.00 (20.0 / 10.0 s) | missed" in float8_line
    )
    # equal gains: met
    assert "| 0.900 | 0.900 | 1.000 [" in report(rows(0.090))
    # the files as written by the benchmark, several at once; no arguments: usage, exit 2
    files = [tmp_path / "compile_float8-unsplit.jsonl", tmp_path / "compile_float8-pipeline.jsonl"]
    everything = rows(0.095)
    for f, part in zip(files, ("unsplit", "pipeline")):
        f.write_text("".join(json.dumps(r) + "\n" for r in everything if r["part"] == part))
    assert len(read_rows(files)) == len(everything)
    assert main([str(f) for f in files]) == 0
    assert main([]) == 2


@pytest.mark.parametrize("missing", ["eager", "compile"])
def test_a_ratio_without_both_variants_is_left_out(missing) -> None:
    kept = [r for r in rows(0.095) if not (r["part"] == "unsplit" and r["variant"] == missing)]
    assert "compile / eager" not in report(kept)
