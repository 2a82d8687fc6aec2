"""``plan_nd_gpu.py --mode synthesized``: per case, the model built that way profiled, the
schedule synthesized for its costs (``planner.synthesize``) beside the planner's best plan at the
same micro-batch count and budget, both run by ``pipetrain train --plan``, and the synthesized
program checked in float64 against the unsplit model (``plan_program_equivalence``).

The budget: the one, of the planner's unconstrained pick's peak times each of
``BUDGET_FRACTIONS`` (before headroom), at which the synthesis gains most in simulation, ties to
the larger — the cases are defined by a budget that keeps the zero-bubble families' peaks out
(``synthesize_cases.py --sweep``), and a re-profiled model's peaks move it; every budget tried
is in the report. ``--memory-gib`` fixes it instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.planner.plan_nd_launch import equivalence, measure, profile
from benchmarks.planner.plan_nd_presets import PRESETS
from pipetrain.planner.costs_file import parse_costs
from pipetrain.planner.layout import Layout
from pipetrain.planner.synthesize import Synthesis, synthesize

#: budgets the synthesized mode tries: the planner's unconstrained pick's peak times these
BUDGET_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
#: a budget no case reaches: the planner's unconstrained pick
UNBOUNDED_GIB = 1e6


def run_synthesized(args: argparse.Namespace, out: Path, meta: dict, started: float) -> int:
    preset = PRESETS[args.preset]
    cases = list(enumerate(preset["synthesized"], start=1))
    if args.cases:
        wanted = {int(c) for c in args.cases.split(",")}
        cases = [c for c in cases if c[0] in wanted]
    failed = 0
    for n, (title, model) in cases:
        if time.monotonic() - started > args.budget_s:  # a new case profiles and checks first
            print(f"--budget-s {args.budget_s:g} reached before case {n}: --resume", flush=True)
            return 1
        folder = out / f"case{n}"
        folder.mkdir(parents=True, exist_ok=True)
        state_file = folder / "report.json"
        if args.resume and state_file.exists():
            saved = json.loads(state_file.read_text())
            runs, launches, case_meta = saved["plan_runs"], saved["launches_by_run"], saved["meta"]
            extra = {"equivalence": saved.get("equivalence"), "budgets": saved.get("budgets")}
        else:
            case_meta = meta | {"case": title, "ranks": args.gpus}
            costs_json = profile(
                sys.executable,
                model,
                folder / "costs.json",
                device=preset["device"],
                repeats=preset["repeats"],
            )
            runs, extra = synthesized_runs(args, parse_costs(costs_json), preset, folder)
            case_meta["memory_gib"] = extra["memory_gib"]
            if args.plan_only:  # the check needs a process per rank
                extra["equivalence"] = {"error": "not run (--plan-only)", "ok": None}
            else:
                extra["equivalence"] = equivalence(
                    sys.executable,
                    Path(runs[0]["plan_file"]),
                    model,
                    folder / "equivalence.json",
                    ranks=args.gpus,
                    device=preset["device"],
                )
            launches = {r["name"]: [] for r in runs}
        print(f"case {n}: {title}", flush=True)
        measure(args, folder, model, runs, launches, case_meta, started, "synthesized", extra)
        failed += (extra.get("equivalence") or {}).get("ok") is False
    return 1 if failed else 0


def synthesized_runs(args, costs, preset: dict, folder: Path) -> tuple[list[dict], dict]:
    """The synthesized program and the planner's best at the chosen budget, as plan files; and
    every budget tried with its simulated speed-up."""
    m = preset["microbatches"]
    tried: list[tuple[float, Synthesis]] = []
    if args.memory_gib is not None:
        budgets = [args.memory_gib]
    else:
        top = synthesize(costs, num_ranks=args.gpus, num_microbatches=m, memory_gib=UNBOUNDED_GIB)
        usable = max(top.baseline.peak_gib) / (1 - top.baseline.headroom)
        budgets = [usable * f for f in BUDGET_FRACTIONS]
    for gib in budgets:
        try:
            tried.append(
                (gib, synthesize(costs, num_ranks=args.gpus, num_microbatches=m, memory_gib=gib))
            )
        except ValueError as e:  # nothing fits this budget, not even the planner's
            print(f"budget {gib:.4g} GiB: {str(e).splitlines()[0][:100]}", flush=True)
    if not tried:
        raise SystemExit(f"no budget of {budgets} has a plan for {folder}")
    gib, best = max(tried, key=lambda t: (t[1].speedup, t[0]))
    synth_file, base_file = folder / "synthesized.json", folder / "planner.json"
    synth_file.write_text(json.dumps(plan_json(best), indent=1) + "\n")
    base_file.write_text(json.dumps(best.baseline.to_json(), indent=1) + "\n")
    base = best.baseline
    runs = [
        synth_run("synthesized", synth_file, best.step_ms, m, list(best.stage_layers), best.how),
        synth_run(
            f"planner's best: {base.schedule} v{base.stages_per_rank}",
            base_file,
            base.step_ms,
            m,
            list(base.stage_layers),
            "pipetrain.plan's search",
        ),
    ]
    budgets_json = [
        {"memory_gib": g, "speedup": s.speedup, "planner": s.baseline.schedule} for g, s in tried
    ]
    return runs, {"memory_gib": gib, "budgets": budgets_json}


def plan_json(result: Synthesis) -> dict:
    """The synthesized plan as ``pipetrain train --plan`` reads it (``pipetrain synthesize
    --json``'s: the program inside, with its prediction and the planner's pick)."""
    plan = Layout.of_program(result.program, result.stage_layers, result.recompute).to_json()
    return plan | {k: v for k, v in result.to_json().items() if k not in plan}


def synth_run(name: str, plan_file: Path, step_ms: float, m: int, cut: list, how: str) -> dict:
    return {
        "name": name,
        "plan_file": str(plan_file),
        "predicted_step_ms": step_ms,
        "predicted_pipeline_ms": step_ms,
        "global_microbatches": m,
        "stage_layers": cut,
        "how": how,
    }
