"""Each incumbents row's GPU clock: the SM clock, power and temperature ``nvidia-smi`` sampled
while the row's timed steps ran, beside the caching allocator's retries per rank
(``gpu_pipeline.guarded``). ``incumbents_call.py`` samples every 200 ms per part into
``<part>.smi.csv``; each row records when its timed steps began and ended (``timed_from``,
``timed_to``) in the same local time, and when the whole row did (``started``, ``ended``). The
timed steps are the window that counts: a row's set-up (building the model, warm-up) idles the
device for seconds, and an idle device's clock and power say nothing about its steps. Rows
written before the timed stamps existed take the sum of their timed steps (``all_ms``) before
their end instead, which holds where nothing ran after the timed steps (no ``--profile`` or
``--timeline-steps``); without ``all_ms`` they fall back to the whole row. The table names the
window it used.

Why: two libraries running the same kernels the same number of times measured about 1% apart
in kernel time (docs/incumbents.md, "1F1B at equal kernels"). A GPU lowers its clock under
sustained power draw, so a row that keeps the device busier may run every kernel slower. This
puts each row's clock beside its step, and pools them per library and configuration.

    python3 benchmarks/incumbents/incumbents_clocks.py WORK_FOLDER > clocks.md
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from datetime import datetime, timedelta
from pathlib import Path

STAMP = "%Y/%m/%d %H:%M:%S.%f"


def samples(path: Path) -> list[tuple[datetime, int, float, float, float]]:
    """(time, GPU index, SM MHz, watts, °C) per line; lines that do not parse are skipped."""
    out = []
    for line in csv.reader(path.read_text().splitlines()):
        try:
            stamp, index, sm, watts, temp = (v.strip() for v in line)
            out.append(
                (datetime.strptime(stamp, STAMP), int(index), float(sm), float(watts), float(temp))
            )
        except ValueError:
            continue
    return out


def window(row: dict) -> tuple[str, datetime, datetime] | None:
    """(what it covers, begin, end): the row's timed steps where it stamped them, else the sum of
    its timed steps before its end, else the whole row, else none."""
    if "timed_from" in row and "timed_to" in row:
        return ("timed steps", _at(row["timed_from"]), _at(row["timed_to"]))
    if "started" not in row or "ended" not in row:
        return None
    if row.get("all_ms"):
        end = _at(row["ended"])
        return ("steps before the end", end - timedelta(milliseconds=sum(row["all_ms"])), end)
    return ("whole row", _at(row["started"]), _at(row["ended"]))


def _at(stamp: str) -> datetime:
    return datetime.strptime(stamp, STAMP)


def row_clock(row: dict, taken: list) -> dict[int, dict[str, float]]:
    """Per GPU, the mean SM MHz and watts and the highest °C sampled in the row's window."""
    span = window(row)
    if span is None:
        return {}
    _, begin, end = span
    per: dict[int, list] = {}
    for when, index, sm, watts, temp in taken:
        if begin <= when <= end:
            per.setdefault(index, []).append((sm, watts, temp))
    return {
        index: {
            "sm_mhz": statistics.fmean(s for s, _, _ in vals),
            "watts": statistics.fmean(w for _, w, _ in vals),
            "max_c": max(t for _, _, t in vals),
            "samples": len(vals),
        }
        for index, vals in sorted(per.items())
    }


def report(work: Path) -> str:
    lines = [
        "| part | row | median ms | sampled over | SM MHz per GPU | W per GPU | max °C "
        "| allocator retries |",
        "|---|---|---|---|---|---|---|---|",
    ]
    pooled: dict[str, list[tuple[float, float]]] = {}
    for result in sorted(work.glob("*/incumbents.json")):
        part = result.parent.name
        smi = work / f"{part}.smi.csv"
        taken = samples(smi) if smi.exists() else []
        for row in json.loads(result.read_text())["rows"]:
            if "median_ms" not in row:
                continue
            clock = row_clock(row, taken)
            retries = "/".join(str(r) for r in row.get("allocator_retries", [])) or "-"
            what = f"{row['shape']} {row['schedule']} n={row['microbatches']} {row['lib']}"
            if not clock:
                lines.append(
                    f"| {part} | {what} | {row['median_ms']:.1f} | | no samples | | | {retries} |"
                )
                continue
            over = window(row)[0]  # type: ignore[index]
            sm = " / ".join(f"{c['sm_mhz']:.0f}" for c in clock.values())
            watts = " / ".join(f"{c['watts']:.0f}" for c in clock.values())
            hot = max(c["max_c"] for c in clock.values())
            lines.append(
                f"| {part} | {what} | {row['median_ms']:.1f} | {over} | {sm} | {watts} | {hot:.0f} "
                f"| {retries} |"
            )
            pooled.setdefault(what, []).append(
                (
                    statistics.fmean(c["sm_mhz"] for c in clock.values()),
                    statistics.fmean(c["watts"] for c in clock.values()),
                )
            )
    lines += [
        "",
        "| row, pooled over launches | rows | mean SM MHz (all GPUs) | mean W (all GPUs) |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {what} | {len(v)} | {statistics.fmean(m for m, _ in v):.0f} "
        f"| {statistics.fmean(w for _, w in v):.0f} |"
        for what, v in sorted(pooled.items())
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(Path(sys.argv[1])))
