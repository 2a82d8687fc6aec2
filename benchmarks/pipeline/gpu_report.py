"""Reporting for ``gpu_pipeline.py``: the JSON file, the Markdown table and the PNG plot.

Split out of the benchmark so the measuring code and the presentation stay apart; it holds no
measurement logic.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

OVERLAP = "pipetrain-overlap"  # Pipeline(overlap_pairs=True): F&B pairs on two lanes (thread + CUDA stream)
REPLAY = "pipetrain-replayw"  # Pipeline(defer_weight_grads=False): graph-replay I/W


def short(res: dict) -> str:
    if "error" in res:
        return "error"
    if "skipped" in res:
        return "skipped: " + res["skipped"]
    return f"{res['median_ms']:.2f} ms, eff {res.get('efficiency', float('nan')):.3f}"


def write_json(out: Path, meta, limits, rows) -> None:
    data = {
        "meta": meta,
        "limits": [dict(v, key=list(k)) for k, v in limits.items()],
        "rows": rows,
    }
    tmp = out / "gpu_pipeline.json.tmp"
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(out / "gpu_pipeline.json")


def fmt(v, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def host_part(res: dict) -> str:
    """`` (0.012)``: the measured bubble's host-bound part, where it was measured."""
    value = res.get("bubble_host_bound")
    return f" ({fmt(value)})" if value is not None else ""


def table(meta, limits, rows) -> str:
    head = (
        "| schedule | mb | lib | step ms med [min–max] | tok/s | TFLOP/s/GPU | eff | "
        "bubble meas (host-bound) | bubble sim (0 / comm) | peak GiB per rank | pred GiB | "
        "pred GiB + workspace | pt/torch |"
    )
    lines = [
        f"## gpu_pipeline: {meta['device']} × {meta['world']}, torch {meta['torch']}, "
        f"{meta['model']}, micro-batch {meta['microbatch_size']}, optimizer {meta['optimizer']}",
        f"comm (one activation, one way): {fmt(meta.get('comm_ms_one_way'))} ms; "
        f"FLOPs/token = {meta['flops_formula']}; eff = {meta['efficiency']}",
        "",
        head,
        "|---" * (head.count("|") - 1) + "|",
    ]
    for r in rows:
        for lib in ("pipetrain", "torch", REPLAY, OVERLAP):
            res = r.get(lib)
            if res is None:
                if lib == "pipetrain" and "skipped" in r:
                    lines.append(
                        f"| {r['schedule']} | {r['microbatches']} | both | {r['skipped']} |"
                    )
                continue
            if "median_ms" not in res:
                why = res.get("error") or res.get("skipped") or "?"
                lines.append(f"| {r['schedule']} | {r['microbatches']} | {lib} | {why} |")
                continue
            peaks = res.get("peak_gib")
            pred = res.get("pred_peak_gib")
            # the simulated workspace model; runs before it saved an additive upper bound
            work = res.get("pred_peak_gib_with_workspace") or res.get(
                "pred_peak_gib_with_transient"
            )
            pred_missing = "-"
            if res.get("pred_error") and res.get("pred_peak_gib_f_only"):
                f_only = "/".join(f"{p:.2f}" for p in res["pred_peak_gib_f_only"])
                pred_missing = f"{f_only} (F-only: no Costs.activation_for_weight)"
            ratio = None
            if lib != "torch" and "median_ms" in r.get("torch", {}):
                ratio = res["median_ms"] / r["torch"]["median_ms"]
            lines.append(
                f"| {r['schedule']} | {r['microbatches']} | {lib} | "
                f"{res['median_ms']:.1f} [{res['min_ms']:.1f}–{res['max_ms']:.1f}] | "
                f"{res['tokens_per_s']:.0f} | {res['tflops_per_gpu']:.3g} | "
                f"{fmt(res.get('efficiency'))} | {fmt(res.get('bubble_measured'))}"
                f"{host_part(res)} | "
                f"{fmt(res.get('bubble_sim_comm0'))} / {fmt(res.get('bubble_sim_comm'))} | "
                f"{'/'.join(f'{p:.2f}' for p in peaks) if peaks else '-'} | "
                f"{'/'.join(f'{p:.2f}' for p in pred) if pred else pred_missing} | "
                f"{'/'.join(f'{p:.2f}' for p in work) if work else '-'} | "
                f"{fmt(ratio) if ratio is not None else ''} |"
            )
    lines += [
        "",
        "act = one micro-batch's forward (limit run); after I = what pipetrain's StageRunner "
        "holds after I, before W (by default the linears' stashed inputs and output gradients; "
        "graph replay: the retained graph + gradients captured for W); MiB per stage; "
        "pred + workspace also places each action's measured workspace (transient) on the "
        "simulated timeline",
        "",
        "| limit (layout, v, mb) | step ms med [min–max] | tok/s | act MiB/stage | "
        "after I MiB/stage |",
        "|---|---|---|---|---|",
    ]

    def mib(d: dict) -> str:
        return " ".join(f"{s}:{b / 2**20:.0f}" for s, b in d.items()) or "-"

    for k, v in limits.items():
        if "median_ms" in v:
            lines.append(
                f"| {k} | {v['median_ms']:.1f} [{v['min_ms']:.1f}–{v['max_ms']:.1f}] | "
                f"{v['tokens_per_s']:.0f} | {mib(v['activation_bytes'])} | "
                f"{mib(v.get('runtime_after_input_bytes') or {})} |"
            )
        else:
            lines.append(f"| {k} | {v.get('error')} | | | |")
    return "\n".join(lines)


def plot(out: Path, rows, n_list, names) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    libs = [
        ("pipetrain", "pipetrain", "tab:blue"),
        ("torch", "torch.distributed.pipelining", "tab:orange"),
    ]
    if any(REPLAY in r for r in rows):
        libs.append((REPLAY, f"{REPLAY} (graph-replay W)", "tab:purple"))
    if any(OVERLAP in r for r in rows):
        libs.append((OVERLAP, f"{OVERLAP} (F&B pairs on two streams)", "tab:green"))
    fig, axes = plt.subplots(2, len(n_list), figsize=(5 * len(n_list), 7.5), squeeze=False)
    for col, n in enumerate(n_list):
        by = {r["schedule"]: r for r in rows if r["microbatches"] == n}
        xs = range(len(names))
        width = 0.8 / len(libs)
        for k, (lib, label, color) in enumerate(libs):
            ms = [by.get(s, {}).get(lib, {}).get("median_ms", 0) or 0 for s in names]
            eff = [by.get(s, {}).get(lib, {}).get("efficiency", 0) or 0 for s in names]
            pos = [x + (k - (len(libs) - 1) / 2) * width for x in xs]
            axes[0][col].bar(pos, ms, width, label=label, color=color)
            axes[1][col].bar(pos, eff, width, label=label, color=color)
        for ax, title in ((axes[0][col], "step time (ms)"), (axes[1][col], "pipeline efficiency")):
            ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{title}, {n} micro-batches", fontsize=9)
        axes[1][col].set_ylim(0, 1.05)
    # one legend for the figure, below the axes, so it never covers a bar
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(libs), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path = out / "gpu_pipeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def host_bound_fraction(timelines) -> float | None:
    """The part of the measured bubble when devices waited for their hosts to issue the next
    action (``Timeline.host_bound_idle``), as a fraction of ranks × makespan like the bubble."""
    parts = [
        sum(t.host_bound_idle) / (t.num_ranks * t.makespan)
        for t in timelines
        if t.host_bound_idle is not None and t.makespan > 0
    ]
    return statistics.fmean(parts) if parts else None


def save_timeline_text(ctx, name: str, n: int, measured, simulated) -> None:
    """The measured and simulated step as text (appended to one file: few files come back), and
    their spans as JSON lines; ``ctx`` is ``gpu_setup.Ctx`` (files go to ``ctx.args.out``)."""
    try:
        from pipetrain.render.text import render_text
    except ImportError:
        return
    try:
        text = render_text(measured, color=False) + "\n" + render_text(simulated, color=False)
    except Exception:
        return
    with open(Path(ctx.args.out) / "timelines.txt", "a") as f:
        f.write(f"==== {name} n={n} (measured, then simulated from measured costs) ====\n")
        f.write(text + "\n")
    # the spans themselves, for looking at where a measured step departs from its simulation
    spans = {
        kind: [[sp.rank, str(sp.action), round(sp.start, 4), round(sp.end, 4)] for sp in t.spans]
        for kind, t in (("measured", measured), ("simulated", simulated))
    }
    with open(Path(ctx.args.out) / "spans.jsonl", "a") as f:
        f.write(json.dumps({"schedule": name, "microbatches": n, **spans}) + "\n")
