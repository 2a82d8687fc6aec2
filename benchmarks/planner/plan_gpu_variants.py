"""What ``plan_gpu.py`` measures: three budgets planned from one costs file, and for each the runs
that judge the planner's pick (docs/planning.md, "Proof on GPUs"). Pure planning, no torch.

* **generous** (``--generous-gib``): memory does not decide;
* **tight**: below the smallest peak any 1F1B candidate of the generous search reaches
  (``--tight-fraction`` of it), where some plan without recompute or offload still fits;
* **memory-bound**: below the smallest peak of every plan without recompute or offload, so the
  planner must recompute or offload, and above the smallest peak full recompute reaches: the
  usable memory (budget less headroom) is ``--bound-fraction`` of the way from the latter to the
  former.

Each budget's runs: the pick; the uniform split of the blocks with 1F1B and torchtitan's rule with
1F1B (the embedding and the head count as one layer each); for the memory-bound budget the pick's
schedule and cut with every stage recomputing none, selective, full or as a whole and offloading
0.5 or 1.0 (alone, or with full recompute; a graphed run neither offloads nor recomputes whole
stages) — ``VARIANTS``, each judged by the planner's own ``evaluate``, so
a stage the runtime cannot offload or recompute plans 0 or none and a variant that comes out equal
to another run is measured once; then up to ``--max-near`` other fitting candidates within
``--near`` of the pick in simulation.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from pipetrain.planner import ModelCosts, search
from pipetrain.planner.judge import Budget, evaluate, simulate_plan
from pipetrain.planner.layout import Layout, default_cut
from pipetrain.planner.partition import uniform_cut
from pipetrain.planner.recompute_modes import describe
from pipetrain.schedule.registry import build_schedule

BUDGETS = ("memory-bound", "tight", "generous")
#: the memory-bound pick's alternatives: (role, every stage's recompute, every stage's offload)
VARIANTS = (
    ("recompute none", "none", 0.0),
    ("selective", "selective", 0.0),
    ("full", "full", 0.0),
    ("whole", "whole", 0.0),
    ("offload 0.5", "none", 0.5),
    ("offload 1.0", "none", 1.0),
    ("full+offload 1.0", "full", 1.0),
)


def plan_budgets(costs: ModelCosts, world: int, counts: list[int], args) -> list[dict]:
    """The budgets of ``args.budgets`` (in ``BUDGETS`` order: the memory-bound one is measured
    first), each with its runs."""
    room = {} if args.headroom is None else {"headroom": args.headroom}

    def find(gib: float):
        return search(costs, num_ranks=world, memory_gib=gib, microbatches=counts,
                      offload=not args.cuda_graph, **room)  # fmt: skip

    generous = find(args.generous_gib)
    out = []
    for label in BUDGETS:
        if label not in args.budgets:
            continue
        notes: dict = {}
        if label == "generous":
            gib, found = args.generous_gib, generous
        elif label == "tight":
            gib, found = tight_budget(generous, find, args.tight_fraction)
        else:
            gib, found, notes = memory_bound_budget(generous, find, args.bound_fraction)
        out.append(budget_runs(label, gib, found, costs, world, args, notes))
    return out


def given_budget(costs: ModelCosts, spec: dict) -> dict:
    """A budget of the runs ``spec`` names (``{"memory_gib", "headroom", "runs": [layouts]}``),
    each predicted by the planner's simulation, the first taken as the pick: to measure chosen
    layouts again without planning (``plan_gpu.py --runs``)."""
    budget = Budget(spec["memory_gib"], spec.get("headroom", 0.1))
    runs = []
    for i, raw in enumerate(spec["runs"]):
        layout = Layout.from_json(raw)
        program = build_schedule(layout.schedule, layout.ranks, layout.microbatches,
                                 layout.stages_per_rank)  # fmt: skip
        judged = evaluate(costs, program, layout.schedule, layout.stages_per_rank,
                          layout.stage_layers, "given", budget, layout.recompute,
                          layout.offload)  # fmt: skip
        runs.append(as_run(judged.plan, "pick" if i == 0 else f"given {i}"))
    return {"budget": "given", "memory_gib": budget.memory_gib, "usable_gib": budget.usable,
            "pick": runs[0], "runs": runs}  # fmt: skip


def plain(c) -> bool:
    return not c.plan.layout.recomputes and not c.plan.layout.offloads


def lowest(candidates) -> float:
    return min(max(c.plan.peak_gib) for c in candidates)


def tight_budget(generous, find, fraction: float):
    """The tightest budget below 1F1B's lowest peak at which some plan without recompute fits."""
    lowest_1f1b = lowest(c for c in generous.candidates if c.plan.schedule == "1f1b")
    for f in (fraction, 0.9, 0.95, 0.98):
        found = find(f * lowest_1f1b)
        if found.fitting and not found.recompute_tried:
            return f * lowest_1f1b, found
    # none below 1F1B's lowest peak: just above the lowest peak the generous search saw
    gib = lowest(generous.candidates) / (1 - generous.candidates[0].plan.headroom) * 1.001
    return gib, find(gib)


def memory_bound_budget(generous, find, fraction: float):
    """A budget no plan without recompute or offload fits and some plan with them does (module
    docstring); with the two peaks it lies between."""
    headroom = generous.candidates[0].plan.headroom
    no_extras = lowest(generous.candidates)
    probe = find(no_extras * 0.999 / (1 - headroom))
    for _ in range(6):  # a lower budget may find a cut without recompute that fits after all
        if probe.recompute_tried:
            break
        no_extras = lowest(c for c in probe.candidates if plain(c) and c.plan.fits) * 0.999
        probe = find(no_extras / (1 - headroom))
    if not probe.recompute_tried:
        raise RuntimeError("found no budget below every plan without recompute")
    recomputing = [c for c in probe.candidates if c.plan.layout.recomputes and not c.plan.layout.offloads]  # fmt: skip
    floor = lowest(recomputing)
    for _ in range(6):
        usable = floor + fraction * (no_extras - floor)
        found = find(usable / (1 - headroom))
        if found.recompute_tried and found.fitting:
            notes = {"lowest_peak_without_extras_gib": no_extras,
                     "lowest_peak_full_recompute_gib": floor, "bound_fraction": fraction}  # fmt: skip
            return usable / (1 - headroom), found, notes
        if not found.recompute_tried:  # a cut without extras fits this one: go below it
            no_extras = lowest(c for c in found.candidates if plain(c) and c.plan.fits) * 0.999
        else:  # nothing fits: further from the floor
            fraction = (1 + fraction) / 2
    raise RuntimeError("found no memory-bound budget at which some plan fits")


def budget_runs(label, gib, found, costs, world, args, notes) -> dict:
    pick = found.best.plan
    runs = [as_run(pick, "pick")]
    budget = Budget(gib, pick.headroom)
    n = costs.num_layers
    for role, cut in (
        ("uniform-1f1b", default_cut(n - 2, world)),
        ("torchtitan-1f1b", uniform_cut(n, world)),
    ):
        program = build_schedule("1f1b", world, pick.microbatches)
        timeline, peaks = simulate_plan(costs, program, cut)
        layout = Layout(schedule="1f1b", ranks=world, stages_per_rank=1,
                        microbatches=pick.microbatches, stage_layers=tuple(cut))  # fmt: skip
        runs.append(run_of(layout, role, timeline.makespan, peaks, budget.usable))
    if label == "memory-bound":
        runs += variant_runs(costs, runs[0], pick, budget, eager=not args.cuda_graph)
    seen = {run_key(r) for r in runs}
    near = 0
    for c in found.near(args.near)[1:]:
        if near >= args.max_near:
            break
        if run_key(as_run(c.plan, "near")) not in seen:
            runs.append(as_run(c.plan, "near"))
            seen.add(run_key(runs[-1]))
            near += 1
    return {"budget": label, "memory_gib": gib, "usable_gib": pick.usable_gib,
            "pick": pick.to_json(), "runs": runs, **notes}  # fmt: skip


def variant_runs(
    costs: ModelCosts, pick_run: dict, pick, budget: Budget, eager: bool = True
) -> list[dict]:
    """The pick's schedule and cut under each of ``VARIANTS`` (not ``eager``: those that offload
    or recompute whole stages left out, which a graphed run cannot); a variant that is the pick,
    or another variant (an offload the schedule leaves no room for), is named in that run's
    ``same_as`` instead."""
    program = build_schedule(pick.schedule, pick.ranks, pick.microbatches, pick.stages_per_rank)
    stages = len(pick.stage_layers)
    out, seen = [], {run_key(pick_run): pick_run}
    for role, mode, fraction in VARIANTS:
        if (fraction or mode == "whole") and not eager:
            continue
        offloads = (fraction,) * stages if fraction else ()
        judged = evaluate(costs, program, pick.schedule, pick.stages_per_rank,
                          pick.stage_layers, role, budget, (mode,) * stages, offloads)  # fmt: skip
        run = as_run(judged.plan, f"variant: {role}")
        if run_key(run) in seen:
            seen[run_key(run)].setdefault("same_as", []).append(role)
        else:
            seen[run_key(run)] = run
            out.append(run)
    return out


def as_run(plan, role: str) -> dict:
    return run_of(plan.layout, role, plan.step_ms, plan.peak_gib, plan.usable_gib)


def run_of(layout: Layout, role: str, step_ms: float, peaks, usable: float) -> dict:
    """A run to measure: its layout (what ``Pipeline.from_plan`` reads) and prediction."""
    return {"role": role, **layout.to_json(), "predicted_step_ms": step_ms,
            "predicted_peak_gib": list(peaks), "predicted_fits": max(peaks) <= usable}  # fmt: skip


def run_key(run: dict) -> str:
    """One distinct program to measure (a run of several roles or budgets is measured once):
    ``schedule/v/M/cut``, then ``/rc:`` and ``/off:`` per stage where it recomputes or offloads
    (one value where every stage has the same)."""
    cut = ",".join(map(str, run["stage_layers"]))
    key = f"{run['schedule']}/v{run['stages_per_rank']}/M{run['microbatches']}/{cut}"
    recompute = run.get("recompute") or ["none"]
    if describe(recompute) != "none":
        key += "/rc:" + same_or_each(describe(recompute).split(","))
    if any(run.get("offload") or ()):
        key += "/off:" + same_or_each([f"{f:g}" for f in run["offload"]])
    return key


def same_or_each(values: list[str]) -> str:
    return values[0] if len(set(values)) == 1 else ",".join(values)
