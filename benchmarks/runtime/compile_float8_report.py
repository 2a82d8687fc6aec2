"""The compile and float8 targets from ``compile_float8_gpu.py``'s rows, with 95% intervals
(docs/benchmarks.md, "torch.compile and float8 under the pipeline").

Reads the ``compile_float8-unsplit.jsonl`` and ``compile_float8-pipeline.jsonl`` files of one or
more launches (each row: part, preset, schedule, variant, launch, per-step times, first step),
and per preset, schedule and weight-gradient split (the variant's ``/defer-…`` suffix) says:

* compile / eager under the pipeline over the same ratio unsplit, and compile+float8 / compile
  likewise: target ≤ 1.03 (a quotient, ``intervals.quotient_interval``; met only where the
  interval's far end is);
* the first step (compilation included) over the unsplit model's: target ≤ 1.5 (the mean over
  launches; no interval: one first step per launch).

    python benchmarks/runtime/compile_float8_report.py OUT/compile_float8-*.jsonl
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.intervals import quotient_interval, verdict

#: (numerator, denominator) variants of each ratio the targets compare
RATIOS = {
    "compile / eager": ("compile", "eager"),
    "float8 / compile": ("compile+float8", "compile"),
}
QUOTIENT_TARGET = 1.03
FIRST_STEP_TARGET = 1.5


def read_rows(paths: Iterable[Path]) -> list[dict]:
    rows = []
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    return rows


def collect(rows: list[dict]) -> dict:
    """``{(part, preset, schedule, split): {variant: {launch: row}}}`` (unsplit rows: schedule
    and split ``None``; a launch's repeated row: the last)."""
    out: dict = defaultdict(lambda: defaultdict(dict))
    for row in rows:
        name = row["variant"]
        base, _, split = name.partition("/")
        key = (row["part"], row["preset"], row.get("schedule"), split or None)
        out[key][base][row.get("launch", 0)] = row
    return out


def _launches(by_launch: dict) -> list[list[float]]:
    return [by_launch[k]["times"] for k in sorted(by_launch)]


def report(rows: list[dict]) -> str:
    groups = collect(rows)
    lines = [
        "| preset | schedule | split | ratio | pipeline | unsplit | quotient [95%] | target ≤ 1.03 |"
        " first step / unsplit's | target ≤ 1.5 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (part, preset, schedule, split), variants in sorted(groups.items(), key=str):
        if part != "pipeline":
            continue
        unsplit = groups.get(("unsplit", preset, None, None), {})
        for label, (num, den) in RATIOS.items():
            if not all(v in variants and v in unsplit for v in (num, den)):
                continue
            a, b = _launches(variants[num]), _launches(variants[den])
            c, d = _launches(unsplit[num]), _launches(unsplit[den])
            iv = quotient_interval(a, b, c, d)
            pipe_ratio = _location(a) / _location(b)
            alone_ratio = _location(c) / _location(d)
            first = statistics.fmean(r["first_s"] for r in variants[num].values())
            first_alone = statistics.fmean(r["first_s"] for r in unsplit[num].values())
            lines.append(
                f"| {preset} | {schedule} | {split or 'default'} | {label} | {pipe_ratio:.3f} | "
                f"{alone_ratio:.3f} | {iv} | {verdict(iv, QUOTIENT_TARGET)} | "
                f"{first / first_alone:.2f} ({first:.1f} / {first_alone:.1f} s) | "
                f"{'met' if first / first_alone <= FIRST_STEP_TARGET else 'missed'} |"
            )
    return "\n".join(lines)


def _location(launches: list[list[float]]) -> float:
    return statistics.fmean(statistics.median(x) for x in launches if x)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    print(report(read_rows(Path(p) for p in argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
