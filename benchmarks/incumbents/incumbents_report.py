"""Tables and target lines of ``incumbents.py``'s results (``incumbents.py --report FILE...``).

Reads the JSON that ``incumbents.py --out`` writes (also ``python incumbents_report.py FILE...``); needs neither torch nor a GPU, so saved
calls can be re-tabled anywhere (docs/incumbents.md's tables come from here).
"""

from __future__ import annotations

import json
from pathlib import Path

PIPETRAIN, TORCH, MEGATRON, MEGATRON_NOSYNC, DEEPSPEED = (
    "pipetrain",
    "torch",
    "megatron",
    "megatron-nosync",
    "deepspeed",
)

PT_FAMILIES = ("1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
#: table order of the schedules (``zb-h1``: pipetrain's and torch's ZB-H1 rows)
ORDER = ("1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
LIB_ORDER = (PIPETRAIN, MEGATRON, DEEPSPEED, TORCH)


def lib_order(lib: str) -> tuple[int, str]:
    """Table order: pipetrain and its variants first, then the incumbents and theirs."""
    base = next((i for i, x in enumerate(LIB_ORDER) if lib.startswith(x)), len(LIB_ORDER))
    return base, lib


def _ms(rows: list[dict], lib: str, name: str | None = None) -> dict | None:
    for r in rows:
        if r["lib"] == lib and (name is None or r["schedule"] == name) and "median_ms" in r:
            return r
    return None


def tables(data: dict) -> str:
    """Markdown: one table per shape × micro-batch count of one run."""
    meta, rows = data["meta"], data["rows"]
    lines = [f"**{meta['device']} × {meta['world']}** ({meta['versions']})", ""]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["microbatches"]), []).append(r)
    for (shape, n), group in groups.items():
        mc_best = min(
            (r["median_ms"] for r in group if r["lib"].startswith(MEGATRON) and "median_ms" in r),
            default=None,
        )
        lines += [
            f"*{shape}, {n} micro-batches, {meta['world']} ranks*",
            "",
            "| schedule | lib | step ms med [min–max] | tok/s | TFLOP/s/GPU | eff | bubble meas / sim "
            "| peak GiB per rank | reserved GiB per rank | / megatron same | / megatron best "
            "| / torch same | / deepspeed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        order = sorted(
            group,
            key=lambda r: (ORDER.index(r["schedule"]), lib_order(r["lib"])),
        )
        for r in order:
            if "median_ms" not in r:
                why = r.get("error") or r.get("skipped") or "?"
                lines.append(f"| {r['schedule']} | {r['lib']} | {why} | | | | | | | | | | |")
                continue
            same = [x for x in group if x["schedule"] == r["schedule"]]

            def ratio(lib: str, _r=r, _same=same) -> str:
                ref = _ms(_same, lib)
                if lib == MEGATRON:  # the fastest Megatron row of the schedule (any variant)
                    megs = [x for x in _same if x["lib"].startswith(MEGATRON) and "median_ms" in x]
                    ref = min(megs, key=lambda x: x["median_ms"], default=None)
                if not _r["lib"].startswith(PIPETRAIN) or ref is None:
                    return ""
                return f"{_r['median_ms'] / ref['median_ms']:.3f}"

            mine = r["lib"].startswith(PIPETRAIN)
            best = f"{r['median_ms'] / mc_best:.3f}" if mc_best and mine else ""
            ds = _ms(group, DEEPSPEED, "1f1b")
            ds_ratio = f"{r['median_ms'] / ds['median_ms']:.3f}" if ds and mine else ""
            mem, reserved = r.get("peak_total_gib"), r.get("peak_reserved_gib")
            eff, bubble = r.get("efficiency"), r.get("bubble_measured")
            lines.append(
                f"| {r['schedule']} | {r['lib']} | {r['median_ms']:.1f} "
                f"[{r['min_ms']:.1f}–{r['max_ms']:.1f}] | {r['tokens_per_s']:.0f} "
                f"| {r['tflops_per_gpu']:.0f} | {'' if eff is None else f'{eff:.3f}'} "
                f"| {_bubbles(bubble, r.get('bubble_simulated'))} "
                f"| {'/'.join(f'{m:.2f}' for m in mem) if mem else '-'} "
                f"| {'/'.join(f'{m:.2f}' for m in reserved) if reserved else '-'} | {ratio(MEGATRON)} "
                f"| {best} | {ratio(TORCH)} | {ds_ratio} |"
            )
        lines.append("")
        lines += profile_table(order)
    return "\n".join(lines)


def _bubbles(measured: float | None, simulated: float | None) -> str:
    """``0.070 / 0.064``: pipetrain's measured bubble and the simulator's from the same step's
    measured stage times (transfers free); one of them, or nothing, where a row lacks them."""
    return " / ".join(f"{b:.3f}" for b in (measured, simulated) if b is not None)


def profile_table(rows: list[dict]) -> list[str]:
    """Per rank, where the profiled step's device time went (rows run with ``--profile``)."""
    traced = [r for r in rows if r.get("profile")]
    if not traced:
        return []
    lines = [
        "| schedule | lib | rank | step ms (profiled) | kernel window ms | idle ms | compute busy ms "
        "| NCCL kernel ms | compute under NCCL ms | kernels |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in traced:
        for p in r["profile"]:
            k = p.get("kernel_ms", {})
            cells = [p.get(c) for c in ("window_ms", "idle_ms", "compute_busy_ms")]
            cells += [k.get("nccl"), p.get("compute_under_nccl_ms")]
            lines.append(
                f"| {r['schedule']} | {r['lib']} | {p['rank']} | {p['step_wall_ms']:.1f} | "
                + " | ".join("" if c is None else f"{c:.1f}" for c in cells)
                + f" | {p.get('kernels', 0)} |"
            )
    return [*lines, ""]


def targets(data: dict) -> str:
    """docs/incumbents.md's targets, met or missed, for one run (markdown bullet list)."""
    meta, rows = data["meta"], data["rows"]
    out = []
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["microbatches"]), []).append(r)
    for (shape, n), group in groups.items():
        where = f"{shape}, {meta['world']} ranks, {n} mb"
        for name in ("1f1b", "interleaved-1f1b"):
            pt = _ms(group, PIPETRAIN, name)
            for lib in (MEGATRON, MEGATRON_NOSYNC, TORCH, DEEPSPEED):
                # DeepSpeed has only 1F1B: both pipetrain families are held to it
                ref = _ms(group, lib, "1f1b" if lib == DEEPSPEED else name)
                if pt is None or ref is None:
                    continue
                q = pt["median_ms"] / ref["median_ms"]
                verdict = "met" if q <= 1.0 else "missed"
                out.append(f"- {where}: pipetrain {name} / {lib}: {q:.3f} ({verdict})")
                for key, what in (("peak_total_gib", "peak"), ("peak_reserved_gib", "reserved")):
                    pm, rm = pt.get(key), ref.get(key)
                    if not (pm and rm and ref["schedule"] == name):  # memory: same schedule only
                        continue
                    worse = [i for i, (a, b) in enumerate(zip(pm, rm)) if a > b]
                    gap = max(a - b for a, b in zip(pm, rm))
                    verdict = "met" if not worse else f"missed on ranks {worse}"
                    out.append(
                        f"- {where}: {what} memory pipetrain {name} ≤ {lib}: "
                        f"{verdict} (largest per-rank difference {gap:+.3f} GiB)"
                    )
        pts = [r for r in group if r["lib"] == PIPETRAIN and "median_ms" in r]
        mcs = [r for r in group if r["lib"].startswith(MEGATRON) and "median_ms" in r]
        if pts and mcs:
            a = min(pts, key=lambda r: r["median_ms"])
            b = min(mcs, key=lambda r: r["median_ms"])
            q = a["median_ms"] / b["median_ms"]
            out.append(
                f"- {where}: pipetrain best ({a['schedule']}) / megatron best ({b['lib']} "
                f"{b['schedule']}): {q:.3f} ({'met' if q <= 0.90 else 'missed'}, target 0.90)"
            )
        bar = 0.97 if n >= 16 else 0.94
        for name in ("zbv", "dualpipev"):
            r = _ms(group, PIPETRAIN, name)
            if r is not None and r.get("efficiency") is not None:
                e = r["efficiency"]
                out.append(
                    f"- {where}: {name} efficiency {e:.3f} ({'met' if e >= bar else 'missed'}, "
                    f"target {bar})"
                )
    return "\n".join(out)


def report(paths: list[Path]) -> str:
    parts = []
    for p in paths:
        data = json.loads(p.read_text())
        parts += [tables(data), targets(data), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/incumbents/incumbents_report.py INCUMBENTS.json ...")
    print(report([Path(p) for p in sys.argv[1:]]))
