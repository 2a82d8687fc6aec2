"""``moe_overlap_gpu.py``'s numbers turned into its table: each row's step time with a 95% interval
over launches and steps, the measured hidden share (from the ``--profile`` run's JSON, when it
is in the same ``--out``), the simulator's prediction and the peak memory per rank (standard
library only).

A row's step time is ``intervals.location``: the mean over launches of each launch's median step
(a step's time is its slowest rank's). Its interval is the two-level percentile bootstrap
``benchmarks/common/intervals.py`` uses for ratios, applied to the location itself: launches
drawn with replacement, then each drawn launch's steps.
"""

from __future__ import annotations

import json
import random
import statistics
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common.intervals import location, ratio_interval

RESULTS, PROFILE, TABLE = "results.json", "profile.json", "table.md"
OVERLAP_ROW, PLAIN_ROW = "dualpipev+overlap", "dualpipev"


def step_interval(
    launches: Sequence[Sequence[float]], resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float] | None:
    """(location, low, high) of a row's step times (module docstring); ``None`` with no steps."""
    runs = [list(x) for x in launches if x]
    if not runs:
        return None
    rng = random.Random(seed)
    draws = []
    for _ in range(resamples):
        picked = [runs[rng.randrange(len(runs))] for _ in runs] if len(runs) > 1 else runs
        draws.append(statistics.fmean(statistics.median(rng.choices(x, k=len(x))) for x in picked))
    draws.sort()
    tail = (1 - level) / 2
    lo = draws[int(tail * len(draws))]
    hi = draws[min(len(draws) - 1, int((1 - tail) * len(draws)))]
    return location(runs), lo, hi


def summarize_timing(launch_rows: dict[str, list]) -> dict:
    """Per row: its interval (ms) from the launches' per-step times (s), and the overlap row's
    step over the plain DualPipeV row's, paired by launch, with its interval."""
    out: dict[str, dict] = {}
    for row, launches in launch_rows.items():
        ms = [[1e3 * t for t in steps] for steps in launches if steps]
        iv = step_interval(ms)
        if iv is not None:
            out[row] = {"step_ms": iv[0], "step_ms_low": iv[1], "step_ms_high": iv[2]}
    if OVERLAP_ROW in launch_rows and PLAIN_ROW in launch_rows:
        ratio = ratio_interval(launch_rows[OVERLAP_ROW], launch_rows[PLAIN_ROW])
        if ratio is not None:
            out.setdefault(OVERLAP_ROW, {})["over_plain"] = [ratio.estimate, ratio.low, ratio.high]
    return out


def _fmt_gib(values) -> str:
    return " / ".join(f"{v:.1f}" for v in values) if values else "-"


def _pct(x) -> str:
    return f"{100 * x:.0f}%" if isinstance(x, (int, float)) else "-"


def table(results: dict | None, profile: dict | None) -> str:
    """The markdown table of every row either JSON has."""
    source = results or profile or {}
    rows = list(source.get("rows", {}))
    prediction = source.get("prediction", {}).get("rows", {})
    lines = [
        "| row | step ms [95%] | hidden (measured) | exposed a2a ms / rank | predicted ms "
        "| predicted hidden | peak GiB / rank |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for row in rows:
        p = (profile or {}).get("rows", {}).get(row, {})
        r = (results or {}).get("rows", {}).get(row) or {k: v for k, v in p.items() if k == "error"}
        pred = prediction.get(row, {})
        if "error" in r:
            step = f"error: {r['error'][:80]}"
        elif "step_ms" in r:
            step = f"{r['step_ms']:.1f} [{r['step_ms_low']:.1f}, {r['step_ms_high']:.1f}]"
        else:
            step = "-"
        exposed = " / ".join(f"{x['exposed_ms']:.1f}" for x in p.get("ranks", [])) or "-"
        predicted = f"{pred['step_ms']:.1f}" if "step_ms" in pred else "-"
        lines.append(
            f"| {row} | {step} | {_pct(p.get('hidden_share'))} | {exposed} | {predicted} "
            f"| {_pct(pred.get('hidden_share'))} | {_fmt_gib(r.get('peak_gib'))} |"
        )
    notes = []
    if profile and profile.get("source") and profile["source"] != "gpu":
        notes.append(f"hidden share and exposed all-to-all: {profile['source']}")
    overlap = (results or {}).get("rows", {}).get(OVERLAP_ROW, {}).get("over_plain")
    if overlap:
        notes.append(
            f"{OVERLAP_ROW} / {PLAIN_ROW} step: {overlap[0]:.3f} [{overlap[1]:.3f}, {overlap[2]:.3f}]"
        )
    plain = (profile or {}).get("rows", {}).get(PLAIN_ROW, {}).get("exposed_share_of_step")
    if plain is not None:
        notes.append(
            f"{PLAIN_ROW} exposes {plain:.0%} of its device time in all-to-all (the shape should "
            "make this >= 15%)"
        )
    hidden = (profile or {}).get("rows", {}).get(OVERLAP_ROW, {}).get("hidden_share")
    if isinstance(hidden, float):
        notes.append(f"hidden share {hidden:.0%} (target >= 80%)")
    for name, note in (source.get("notes") or {}).items():
        notes.append(f"{name}: {note}")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def write_table(out: Path) -> str:
    """``table.md`` from whichever of ``results.json`` and ``profile.json`` are in ``out``."""
    found = {}
    for name in (RESULTS, PROFILE):
        path = out / name
        found[name] = json.loads(path.read_text()) if path.exists() else None
    text = table(found[RESULTS], found[PROFILE])
    (out / TABLE).write_text(text)
    return text
