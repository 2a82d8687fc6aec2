"""What ``recompute_cost_gpu.py`` reports from its rows (no torch): each recomputing pipeline
row's step against the same row without recompute, the unsplit model's ratio for the same
recompute and their quotient (target ``TARGET``), the rows whose first loss or gradient sums
differ from their row without recompute, one line per row, and the JSON file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

#: what each row recomputes inside its stages
MODES = ("none", "full", "selective", "whole")
#: a recomputing pipeline row meets the target where its quotient is at most this
TARGET = 1.03


def compare(rows: list[dict], cpu: bool) -> tuple[list[str], list[dict]]:
    """Mismatches (first losses unlike their ``none`` row's, gradient sums beyond round-off)
    and, per recomputing pipeline row, its ratio, the unsplit model's and their quotient."""
    tolerance = 1e-6 if cpu else 1e-2
    base = {(r["kind"], r.get("schedule"), r.get("split")): r for r in rows
            if r["recompute"] == "none" and "step_ms" in r}  # fmt: skip
    unsplit = {r["recompute"]: r for r in rows if r["kind"] == "unsplit" and "step_ms" in r}
    problems, ratios = [], []
    for r in rows:
        ref = base.get((r["kind"], r.get("schedule"), r.get("split")))
        if r["recompute"] == "none" or ref is None or "step_ms" not in r:
            continue
        label = " ".join(str(r[k]) for k in ("kind", "schedule", "split", "recompute") if k in r)
        if r["first_loss"] != ref["first_loss"]:
            problems.append(f"{label}: first loss {r['first_loss']!r} != {ref['first_loss']!r}")
        for got, want in zip(r["grad_sq"], ref["grad_sq"], strict=True):
            if abs(got - want) > tolerance * max(abs(want), 1e-30):
                problems.append(f"{label}: squared gradient sum {got!r} != {want!r}")
        if r["kind"] != "pipeline" or r["recompute"] not in unsplit or "none" not in unsplit:
            continue
        ratio_pipe = r["step_ms"] / ref["step_ms"]
        ratio_unsplit = unsplit[r["recompute"]]["step_ms"] / unsplit["none"]["step_ms"]
        quotient = ratio_pipe / ratio_unsplit
        ratios.append({"schedule": r["schedule"], "split": r["split"], "recompute": r["recompute"],
                       "ratio_pipe": ratio_pipe, "ratio_unsplit": ratio_unsplit,
                       "quotient": quotient, "meets": quotient <= TARGET})  # fmt: skip
    return problems, ratios


def line(row: dict, ratios: list[dict]) -> str:
    where = f"{row['schedule']} {row['split']}" if row["kind"] == "pipeline" else row["kind"]
    if row["kind"] == "unsplit" and row.get("cuda_graph"):
        where = "unsplit, graphed"
    head = f"{where:<26} {row['recompute']:<9}"
    if "error" in row:
        return f"{head} FAILED {row['error'][:300]}"
    if "skipped" in row:
        return f"{head} skipped ({row['skipped']})"
    peak = ", ".join("-" if p is None else f"{p:.2f}" for p in row["peak_gib"])
    text = f"{head} step {row['step_ms']:8.1f} ms  peak GiB [{peak}]  loss {row['first_loss']:.6g}"
    mine = [q for q in ratios if (q["schedule"], q["split"], q["recompute"])
            == (row.get("schedule"), row.get("split"), row["recompute"])]  # fmt: skip
    for q in mine:
        text += (f"  x none {q['ratio_pipe']:.3f}, unsplit x {q['ratio_unsplit']:.3f}, "
                 f"quotient {q['quotient']:.3f} {'ok' if q['meets'] else 'OVER'}")  # fmt: skip
    return text


def summary(ratios: list[dict]) -> list[str]:
    """Per recompute mode, how many rows meet the target and the worst quotient."""
    lines = []
    for mode in MODES[1:]:
        mine = [q for q in ratios if q["recompute"] == mode]
        if mine:
            worst = max(mine, key=lambda q: q["quotient"])
            over = sum(not q["meets"] for q in mine)
            lines.append(f"{mode}: {len(mine) - over} of {len(mine)} rows within {TARGET}; "
                         f"worst {worst['quotient']:.3f} ({worst['schedule']} {worst['split']})")  # fmt: skip
    return lines


def write(out: Path, meta: dict, rows: list[dict], problems: list[str], ratios: list[dict]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"meta": meta, "rows": rows, "ratios": ratios, "mismatches": problems}
    out.write_text(json.dumps(report, indent=1))


def pooled(reports: list[dict]) -> list[dict]:
    """Per recomputing pipeline row measured in every launch (``reports``, one
    ``recompute_cost.json`` each): its quotient over the launches with a 95% interval
    (``intervals.quotient_interval``: the pipeline's ratio to its row without recompute, over
    the unsplit model's ratio for the same recompute; the step times' medians averaged over
    launches, launches and steps resampled) and whether the interval's far end meets the
    target."""
    from benchmarks.common.intervals import quotient_interval

    def steps(rows: list[dict], key: tuple) -> list[float]:
        found = [r for r in rows if (r["kind"], r.get("schedule"), r.get("split"),
                                     r["recompute"]) == key and "all_ms" in r]  # fmt: skip
        return found[0]["all_ms"] if found else []

    keys = [(r["kind"], r.get("schedule"), r.get("split"), r["recompute"])
            for r in reports[0]["rows"] if r["kind"] == "pipeline" and r["recompute"] != "none"]  # fmt: skip
    launches = [rep["rows"] for rep in reports]
    out = []
    for kind, schedule, split, mode in keys:
        iv = quotient_interval(
            [steps(rows, (kind, schedule, split, mode)) for rows in launches],
            [steps(rows, (kind, schedule, split, "none")) for rows in launches],
            [steps(rows, ("unsplit", None, None, mode)) for rows in launches],
            [steps(rows, ("unsplit", None, None, "none")) for rows in launches],
        )
        if iv is not None:
            out.append({"schedule": schedule, "split": split, "recompute": mode,
                        "quotient": iv.estimate, "low": iv.low, "high": iv.high,
                        "launches": iv.launches, "meets": iv.high <= TARGET})  # fmt: skip
    return out


def pooled_lines(rows: list[dict]) -> list[str]:
    """A markdown table of ``pooled``'s rows, then per mode how many meet the target."""
    lines = ["| schedule | split | recompute | quotient [95%] | launches | ≤ 1.03 |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for q in rows:
        lines.append(f"| {q['schedule']} | {q['split']} | {q['recompute']} | {q['quotient']:.3f} "
                     f"[{q['low']:.3f}, {q['high']:.3f}] | {q['launches']} | "
                     f"{'yes' if q['meets'] else 'no' if q['low'] > TARGET else 'undecided'} |")  # fmt: skip
    for mode in sorted({q["recompute"] for q in rows}):
        mine = [q for q in rows if q["recompute"] == mode]
        met = sum(q["meets"] for q in mine)
        lines.append(f"\n{mode}: {met} of {len(mine)} rows meet {TARGET} at the interval's far end")
    return lines


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        raise SystemExit("usage: recompute_cost_report.py LAUNCH.json [LAUNCH.json ...]")
    print("\n".join(pooled_lines(pooled([json.loads(Path(p).read_text()) for p in sys.argv[1:]]))))
