"""What ``plan_nd_gpu.py`` reports from its runs' launches (standard library only; rewritten after
every launch, so a call cut short keeps what it measured).

Per run (a plan file ``pipetrain train --plan`` ran): the predicted step, the measured step —
the mean over launches of each launch's median timed step, with its 95% two-level bootstrap
interval over launches and steps (``benchmarks.common.intervals``) — the prediction error
(predicted / measured − 1), and the same for the pipeline's step alone (the run report's
measured makespan against the plan's ``pipeline_ms``). The training step carries AdamW's update
and the gradient norm, which the planner does not price, so its error reads high by their time;
the pipeline error is the planner's own.

Per mode: ``nd`` — the regret, the pick's measured time per global micro-batch (step ÷
(micro-batches × dp)) over the best measured run's, less one, with its interval from the paired
launches (the pick and that run rotated through the same launches), and whether it meets the
target (``REGRET_WITHIN``, met only where the interval's far end is within it); ``synthesized`` —
the planner's best plan's measured step over the synthesized program's (the speed-up), with its
interval, beside the simulated speed-up, and the float64 equivalence.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.common.intervals import Interval, location, ratio_interval, verdict

#: the pick's regret target (issue: the pick's measured step over the best measured, ≤ 3%)
REGRET_WITHIN = 0.03
RESAMPLES = 2000


def location_interval(
    launches: Sequence[Sequence[float]], *, resamples: int = RESAMPLES, seed: int = 0
) -> Interval | None:
    """``location(launches)`` (the mean of launch medians) with a two-level percentile bootstrap
    interval: launches drawn with replacement, then each drawn launch's steps. ``None`` without
    a timed step."""
    runs = [list(x) for x in launches if x]
    if not runs:
        return None
    rng = random.Random(seed)
    k, median = len(runs), statistics.median
    draws = sorted(
        statistics.fmean(
            median(rng.choices(runs[i], k=len(runs[i])))
            for i in (rng.randrange(k) for _ in range(k))
        )
        for _ in range(resamples)
    )
    lo, hi = draws[int(0.025 * resamples)], draws[min(resamples - 1, int(0.975 * resamples))]
    return Interval(location(runs), lo, hi, k, min(len(x) for x in runs))


def per_global(launches: list[dict], count: int) -> list[list[float]]:
    """Each launch's step times per global micro-batch (empty for a failed launch)."""
    return [[t / count for t in launch.get("steps_ms", [])] for launch in launches]


def run_row(run: dict, launches: list[dict]) -> dict:
    """One run's prediction beside what its launches measured."""
    row = {k: v for k, v in run.items() if k != "plan"}
    row["launches"] = launches
    row["errors"] = [x["error"] for x in launches if "error" in x]
    row["predicted_ms_per_global_microbatch"] = (
        run["predicted_step_ms"] / run["global_microbatches"]
    )
    step = location_interval([x.get("steps_ms", []) for x in launches])
    if step is None:
        return row
    predicted = run["predicted_step_ms"]
    row["measured_step_ms"] = interval_json(step)
    row["step_error"] = predicted / step.estimate - 1
    count = run["global_microbatches"]
    row["measured_ms_per_global_microbatch"] = step.estimate / count
    pipelines = [x["pipeline_ms"] for x in launches if x.get("pipeline_ms")]
    if pipelines:
        row["measured_pipeline_ms"] = statistics.fmean(pipelines)
        row["pipeline_error"] = run["predicted_pipeline_ms"] / row["measured_pipeline_ms"] - 1
    return row


def interval_json(iv: Interval) -> dict:
    return {
        "estimate": iv.estimate,
        "low": iv.low,
        "high": iv.high,
        "launches": iv.launches,
        "steps": iv.steps,
    }


def summarize(mode: str, runs: list[dict], launches: dict[str, list[dict]], meta: dict) -> dict:
    """The report: every run's row, and the mode's verdicts (module docstring)."""
    rows = [run_row(r, launches.get(r["name"], [])) for r in runs]
    report: dict = {"mode": mode, **meta, "runs": rows}
    done = [r for r in rows if "measured_step_ms" in r]
    if mode == "nd" and done and "measured_step_ms" in rows[0]:
        report |= regret(rows[0], done, launches)
    if mode == "synthesized" and len(rows) == 2:
        synth, base = rows
        report["predicted_speedup"] = (
            base["predicted_ms_per_global_microbatch"] / synth["predicted_ms_per_global_microbatch"]
        )
        a = per_global(launches.get(base["name"], []), base["global_microbatches"])
        b = per_global(launches.get(synth["name"], []), synth["global_microbatches"])
        iv = ratio_interval(a, b, resamples=RESAMPLES)
        if iv is not None:
            report["speedup"] = interval_json(iv)
    return report


def regret(pick: dict, done: list[dict], launches: dict[str, list[dict]]) -> dict:
    """The pick's regret against the best measured run, with its interval and verdict."""
    best = min(done, key=lambda r: r["measured_ms_per_global_microbatch"])
    out: dict = {
        "best_measured": best["name"],
        "regret": pick["measured_ms_per_global_microbatch"]
        / best["measured_ms_per_global_microbatch"]
        - 1,
    }
    if best is pick:
        out["regret_verdict"] = "met (the pick measured fastest)"
        return out
    a = per_global(launches[pick["name"]], pick["global_microbatches"])
    b = per_global(launches[best["name"]], best["global_microbatches"])
    iv = ratio_interval(a, b, resamples=RESAMPLES)
    if iv is not None:
        out["regret_interval"] = interval_json(iv)
    out["regret_verdict"] = verdict(iv, 1 + REGRET_WITHIN)
    return out


def format_report(report: dict) -> str:
    """The printed table: one line per run, then the mode's verdicts."""
    lines = [f"{report['mode']}: {report.get('device', '?')}, {report.get('date', '')}"]
    lines.append(f"command: {report.get('command', '')}")
    if report.get("case"):
        lines.append(
            f"case: {report['case']}, {report.get('ranks')} ranks, budget "
            f"{report.get('memory_gib', 0):.4g} GiB"
        )
    if report.get("stopped"):
        lines.append(f"stopped early: {report['stopped']} (--resume continues)")
    tp = report.get("tp")
    if tp:
        derived = tp.get("derived") or []
        lines.append(
            f"tensor-parallel degrees profiled: {tp.get('degrees')}, derived (not "
            f"measured): {derived or 'none'}"
        )
    if "cli_pick_agrees" in report:
        lines.append(
            "`pipetrain plan --gpus --json` picks the same layout: "
            + ("yes" if report["cli_pick_agrees"] else "NO")
        )
    header = (
        f"{'run':<34} {'pred ms':>9} {'measured ms [95%]':>28} {'error':>7} "
        f"{'pipe ms':>9} {'pipe err':>8} {'ms/global mb':>12}"
    )
    lines.append(header)
    for r in report["runs"]:
        name = r["name"] + (" (beyond --near)" if r.get("within_near") is False else "")
        head = f"{name:<34} {r['predicted_step_ms']:9.2f}"
        if "measured_step_ms" not in r:
            why = r["errors"][0] if r["errors"] else "not measured"
            per = r["predicted_ms_per_global_microbatch"]
            lines.append(f"{head}  {why[:110]} (predicted {per:.3f} ms per global micro-batch)")
            continue
        m = r["measured_step_ms"]
        cell = f"{m['estimate']:.2f} [{m['low']:.2f}, {m['high']:.2f}]"
        pipe = r.get("measured_pipeline_ms")
        pipe_cells = f"{pipe:9.2f} {r['pipeline_error']:+8.1%}" if pipe else f"{'-':>9} {'-':>8}"
        lines.append(
            f"{head} {cell:>28} {r['step_error']:+7.1%} {pipe_cells} "
            f"{r['measured_ms_per_global_microbatch']:12.3f}"
        )
        if r["errors"]:
            lines.append(f"  {len(r['errors'])} launch(es) failed: {r['errors'][0][:120]}")
    if "regret" in report:
        iv = report.get("regret_interval")
        at = f" [{iv['low'] - 1:+.1%}, {iv['high'] - 1:+.1%}]" if iv else ""
        lines.append(
            f"regret: {report['regret']:+.1%}{at} against {report['best_measured']} "
            f"(target <= {REGRET_WITHIN:.0%}: {report['regret_verdict']})"
        )
    if "predicted_speedup" in report and "speedup" not in report:
        lines.append(f"speed-up predicted: {report['predicted_speedup']:.3f}x (not measured)")
    if "speedup" in report:
        s = report["speedup"]
        lines.append(
            f"speed-up of the synthesized program over the planner's best: measured "
            f"{s['estimate']:.3f}x [{s['low']:.3f}, {s['high']:.3f}], predicted "
            f"{report['predicted_speedup']:.3f}x"
        )
    if "equivalence" in report:
        eq = report["equivalence"]
        if eq.get("ok") is None:
            lines.append(f"float64 equivalence: {eq.get('error', 'not run')}")
        elif "error" in eq:
            lines.append(f"float64 equivalence: FAILED to run: {eq['error'][:150]}")
        else:
            lines.append(
                f"float64 equivalence ({eq['backend']}): loss {eq['loss_rel_err']:.1e}, worst "
                f"gradient {eq['grad_rel_err']:.1e} relative (<= {eq['tolerance']:g}: "
                f"{'yes' if eq['ok'] else 'NO'})"
            )
    lines.append(
        "error: predicted / measured - 1; measured: the training step (AdamW and the gradient "
        "norm included, which the planner does not price); pipe: the pipeline's step alone "
        "(the run report's measured makespan) against the plan's pipeline prediction"
    )
    return "\n".join(lines)
