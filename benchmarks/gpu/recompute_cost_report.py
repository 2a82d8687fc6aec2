"""What ``recompute_cost_gpu.py`` reports from its rows (no torch): each recomputing pipeline
row's step against the same row without recompute, the unsplit model's ratio for the same
recompute and their quotient (target ``TARGET``), the rows whose first loss or gradient sums
differ from their row without recompute, one line per row, and the JSON file."""

from __future__ import annotations

import json
from pathlib import Path

#: what each row recomputes inside its stages
MODES = ("none", "full", "selective")
#: a pipeline mode the unsplit model is not measured in, and the unsplit row it is held against:
#: a stage recomputed as a whole runs the same extra forward as full recompute
REFERENCE = {"whole": "full"}
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
        against = REFERENCE.get(r["recompute"], r["recompute"])
        if r["kind"] != "pipeline" or against not in unsplit or "none" not in unsplit:
            continue
        ratio_pipe = r["step_ms"] / ref["step_ms"]
        ratio_unsplit = unsplit[against]["step_ms"] / unsplit["none"]["step_ms"]
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
    for mode in (*MODES[1:], *REFERENCE):
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
