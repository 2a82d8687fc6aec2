"""Where a planner run's prediction error comes from, for ``plan_gpu.py``: each measured run's
mean action per (kind, stage) against its price (and, for an eager step, each host's issue time
against its host price), the program simulated with its own measured means, and the layers timed
alone; and the best of a run's rounds."""

from __future__ import annotations

import dataclasses
import statistics

from pipetrain.planner import ModelCosts
from pipetrain.planner.search import stage_costs
from pipetrain.runtime.profile.profile_layers import RATIO_OF, TIMES
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.timeline import Timeline
from pipetrain.sim.costs import mean_durations, measured_costs
from pipetrain.sim.simulate import simulate


def lone_costs(costs: ModelCosts) -> ModelCosts:
    """The costs as the layers measured alone (the profiler's window ratios undone)."""
    layers = list(costs.layers)
    for w in costs.meta.get("context", {}).get("windows", []):
        for i in range(w["first"], w["end"]):
            layers[i] = dataclasses.replace(
                layers[i],
                **{k: getattr(layers[i], k) / w[RATIO_OF[k]] for k in TIMES if RATIO_OF[k] in w},
            )
    return dataclasses.replace(costs, layers=tuple(layers))


def explain(run, program, timeline, costs) -> dict:
    """Where a prediction error comes from: the measured mean action per (kind, stage) against
    the costs file's stage sums and the layers timed alone, the program simulated with its own
    measured means (right there: the schedule model holds and the stage costs are off)."""
    cut = run["stage_layers"]
    extras = (run.get("recompute") or (), run.get("offload") or ())
    means = mean_durations([timeline])
    try:  # an offloading program's copies are not in the measured means
        own = simulate(program, measured_costs([timeline], program.num_stages)).makespan
    except Exception:
        own = None
    predicted = stage_costs(costs, program, cut, *extras)
    lone = stage_costs(lone_costs(costs), program, cut, *extras)
    host = Timeline(timeline.num_ranks, timeline.host_spans, timeline.activation_size)
    host_means = mean_durations([host]) if timeline.host_spans else {}
    per_stage = []
    for s in range(program.num_stages):
        row: dict = {"stage": s}
        for kind, attr in ((OpKind.F, "forward"), (OpKind.B, "backward"),
                           (OpKind.I, "backward_input"), (OpKind.W, "backward_weight")):  # fmt: skip
            if (kind, s) in means:
                row[attr] = {"measured": means[kind, s], "predicted": getattr(predicted, attr)[s],
                             "alone": getattr(lone, attr)[s]}  # fmt: skip
            if (kind, s) in host_means and predicted.host is not None:
                row[attr]["host_measured"] = host_means[kind, s]
                row[attr]["host_predicted"] = getattr(predicted.host, attr)[s]
        per_stage.append(row)
    try:
        alone_ms = simulate(program, lone).makespan
    except Exception:
        alone_ms = None
    return {
        "timeline_step_ms": timeline.makespan,
        "host_between_ms": [statistics.fmean(g) if g else 0.0 for g in timeline.host_gaps]
        if timeline.host_spans
        else None,
        "simulated_with_own_means_ms": own,
        "predicted_from_lone_layers_ms": alone_ms,
        "stages": per_stage,
    }


def best_round(measured: list[dict]) -> dict:
    """A run's fastest round (its timeline and stages with it), every round's step, the highest
    peak of any round; a run that failed in every round keeps its error."""
    done = [m for m in measured if "error" not in m]
    if not done:
        return measured[-1]
    best = min(done, key=lambda m: m["step_ms"])
    peaks = [max(m["peak_gib"][r] for m in done) for r in range(len(best["peak_gib"]))]
    return {**best, "peak_gib": peaks, "rounds_step_ms": [m["step_ms"] for m in done]}
