"""N-D plans and synthesized schedules measured on GPUs against their predictions (docs/planning.md,
"Measuring plans on GPUs"). A benchmark, not a test; every step is a ``pipetrain`` command.

    python benchmarks/planner/plan_nd_gpu.py --mode nd --gpus 8 --out $OUT/nd          # GPUs
    python benchmarks/planner/plan_nd_gpu.py --mode synthesized --gpus 4 --out $OUT/syn
    python benchmarks/planner/plan_nd_gpu.py --mode synthesized --preset cpu-smoke --out /tmp/s

``--plan-only`` profiles and plans and runs nothing (one GPU's share of the work: the costs and
the predicted table, the float64 check left out). A device call stops at 10 minutes: give ``--budget-s`` below it (say 480) and continue with the
same command and ``--resume`` until every run has its launches.

``--mode nd`` (4 or 8 GPUs): ``pipetrain profile --tp 1,2,4[,8]`` (degrees the machine does not
measure are derived: the costs file's ``meta.tp`` says which, and the report repeats it), then
the pp × tp × dp search (``planner.nd_search``, the same as ``pipetrain plan --gpus N
--gpus-per-node N --json``, whose pick is checked to be the same; here every shape is simulated,
``exhaustive``, because the command's bound skips shapes that cannot win but may still lie within
``--near`` of the pick), at a fixed global batch so every shape trains the same tokens a step.
The runs: the pick and every other shape's best plan within ``--near`` (10%) of the pick's
predicted time per global micro-batch; where none is, the runner-up shape all the same (a regret
needs something to be measured against; its run says ``within_near: false``).

``--mode synthesized`` (2 or 4 GPUs): per case of ``synthesize_cases.py`` (a heavy head at a 128k
vocabulary, a 256k vocabulary with a tied embedding, 13 blocks on 4 ranks), the model built that
way is profiled, and the schedule synthesized for those costs (``planner.synthesize``) runs
beside the planner's best plan at the same micro-batch count and budget. The budget is the one,
of the planner's unconstrained pick's peak times each of ``BUDGET_FRACTIONS``, at which the
synthesis gains most in simulation (the cases are defined by a budget that keeps the
zero-bubble families' peaks out; every budget tried is in the report), unless ``--memory-gib``
fixes it. The synthesized program is also checked in float64 against the unsplit model
(``plan_program_equivalence``, NCCL on GPUs) within 1e-12.

Every run is a plan file run by ``pipetrain train --plan`` in ``--launches`` launches (separate
processes, the runs' order rotated between launches), ``--warmup`` untimed then ``--steps`` timed
steps each (``plan_nd_launch``); the report (``plan_nd_report``) is rewritten after every launch
under ``--out`` (``report.json``, ``summary.txt``), and ``--resume`` continues a call cut short
(a device call's wall limit) with the launches it lacks. No launch starts after ``--budget-s``.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.planner.plan_nd_launch import Model, checkout_env, measure, profile
from benchmarks.planner.plan_nd_presets import PRESETS
from benchmarks.planner.plan_nd_synthesized import run_synthesized
from pipetrain.planner.costs_file import parse_costs
from pipetrain.planner.nd_search import Cluster, NdPlan, nd_search

MODES = ("nd", "synthesized")


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--preset", choices=PRESETS, default="h200")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="nd: GPUs to plan for and run on (4 or 8); synthesized: pipeline ranks "
        "(2 or 4) (default: 8 and 4; cpu-smoke 2 processes)",
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--near",
        type=float,
        default=None,
        help="nd: shapes within this of the pick (default 0.10; cpu-smoke every "
        "shape, so that tp and dp both run)",
    )
    p.add_argument("--memory-gib", type=float, default=None, help="the budget (default: preset)")
    p.add_argument("--launches", type=int, default=None, help="launches per run (default 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per launch (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    p.add_argument("--cases", default=None, help="synthesized: case numbers, e.g. 1,3")
    p.add_argument("--budget-s", type=float, default=3000.0, help="no launch starts after")
    p.add_argument("--resume", action="store_true", help="continue the call in --out")
    p.add_argument(
        "--plan-only",
        action="store_true",
        help="profile and plan (or synthesize), write the plan files and the predictions, run "
        "nothing: on one GPU, the table a call of several GPUs would measure",
    )
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    args.device, args.launch_s = preset["device"], preset["launch_s"]
    for key in ("launches", "steps", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.gpus is None:
        args.gpus = 2 if args.preset == "cpu-smoke" else {"nd": 8, "synthesized": 4}[args.mode]
    if args.launches < 1 or args.steps < 1 or args.warmup < 0 or args.gpus < 1:
        p.error("--launches, --steps and --gpus must be >= 1, --warmup >= 0")
    if args.plan_only:
        args.launches = 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    meta = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": device_name(PRESETS[args.preset]["device"], args.gpus),
        "host": platform.node(),
        "launches": args.launches,
        "steps": args.steps,
        "warmup": args.warmup,
    }
    if args.mode == "nd":
        return run_nd(args, out, meta, started)
    return run_synthesized(args, out, meta, started)


def device_name(device: str, count: int) -> str:
    """``8 x NVIDIA H200`` (from ``nvidia-smi``), or ``cpu (gloo)``."""
    if device == "cpu":
        return f"cpu (gloo, {count} processes)"
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return f"{count} x cuda"
    return f"{count} x {names[0].strip() or 'cuda'}"


def run_nd(args: argparse.Namespace, out: Path, meta: dict, started: float) -> int:
    preset = PRESETS[args.preset]
    spec = preset["nd"]
    model: Model = spec["model"]
    memory = args.memory_gib or spec["memory_gib"]
    state_file = out / "report.json"
    if args.resume and state_file.exists():
        saved = json.loads(state_file.read_text())
        runs, launches, meta = saved["plan_runs"], saved["launches_by_run"], saved["meta"]
    else:
        degrees = tuple(t for t in (1, 2, 4, 8) if t <= args.gpus)
        costs_json = profile(
            sys.executable,
            model,
            out / "costs.json",
            device=preset["device"],
            tp=degrees,
            link_gbs=spec["link_gbs"],
            repeats=preset["repeats"],
        )
        costs = parse_costs(costs_json)
        meta["tp"] = costs.meta.get("tp")
        cluster = Cluster(
            gpus=args.gpus,
            gpus_per_node=args.gpus,
            link_gbs=spec["link_gbs"] or costs.tp_link_gbs or 100.0,
            node_link_gbs=25.0,
        )
        found = nd_search(
            costs,
            cluster,
            memory_gib=memory,
            global_batch=spec["global_batch"],
            micro_batch_size=model.micro_batch_size,
            exhaustive=True,
        )
        meta["memory_gib"], meta["global_batch"] = memory, spec["global_batch"]
        meta["cli_pick"] = cli_pick(out / "costs.json", args.gpus, cluster, memory, spec, model)
        meta["cli_pick_agrees"] = same_layout(meta["cli_pick"], found.best.to_json())
        near = spec["near"] if args.near is None else args.near
        runs = nd_runs(found.ranked, near, out)
        launches = {r["name"]: [] for r in runs}
    measure(args, out, model, runs, launches, meta, started, "nd")
    return 0


def cli_pick(costs: Path, gpus: int, cluster: Cluster, memory: float, spec: dict, model) -> dict:
    """``pipetrain plan --gpus N --gpus-per-node N --json``'s pick, for the same search."""
    argv = [
        sys.executable,
        "-m",
        "pipetrain",
        "plan",
        "--costs",
        str(costs),
        "--gpus",
        str(gpus),
        "--gpus-per-node",
        str(gpus),
        "--link-gbs",
        f"{cluster.link_gbs!r}",
        "--memory-gib",
        f"{memory!r}",
        "--global-batch",
        str(spec["global_batch"]),
        "--micro-batch-size",
        str(model.micro_batch_size),
        "--json",
    ]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=checkout_env())
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-300:]}
    return json.loads(done.stdout)


def same_layout(a: dict, b: dict) -> bool:
    """Whether two plan JSONs carry the same layout (their predictions aside)."""
    return {k: v for k, v in a.items() if k != "predicted"} == {
        k: v for k, v in b.items() if k != "predicted"
    }


#: shapes run at least (the pick and its runner-up where none other is within ``--near``): a
#: regret against nothing measured says nothing
MIN_SHAPES = 2


def nd_runs(ranked: list[NdPlan], near: float, out: Path) -> list[dict]:
    """The pick and every other shape's best plan within ``near`` of it (per global
    micro-batch), at least ``MIN_SHAPES`` of them, each written as a plan file."""
    pick = ranked[0]
    limit = pick.ms_per_global_microbatch * (1 + near)
    runs = []
    for i, nd in enumerate(ranked):
        within = nd.ms_per_global_microbatch <= limit
        if not within and i >= MIN_SHAPES:
            continue
        s = nd.shape
        name = ("pick: " if nd is pick else "") + f"pp {s.pp} x tp {s.tp} x dp {s.dp}"
        plan_file = out / f"plan-pp{s.pp}-tp{s.tp}-dp{s.dp}.json"
        plan_file.write_text(json.dumps(nd.to_json(), indent=1) + "\n")
        runs.append(
            {
                "name": name,
                "plan_file": str(plan_file),
                "shape": [s.pp, s.tp, s.dp],
                "schedule": nd.plan.schedule,
                "stages_per_rank": nd.plan.stages_per_rank,
                "microbatches": nd.plan.microbatches,
                "stage_layers": list(nd.plan.stage_layers),
                "recompute": list(nd.plan.recompute),
                "predicted_step_ms": nd.step_ms,
                "predicted_pipeline_ms": nd.plan.step_ms,
                "predicted_peak_gib": list(nd.plan.peak_gib),
                "predicted_behind_pick": nd.ms_per_global_microbatch / pick.ms_per_global_microbatch
                - 1,
                "global_microbatches": nd.plan.microbatches * s.dp,
                "within_near": within,
            }
        )
    return runs


if __name__ == "__main__":
    raise SystemExit(main())
