"""N-D plans and synthesized schedules measured on GPUs against their predictions (docs/planning.md,
"Measuring plans on GPUs"). A benchmark, not a test; every step is a ``pipetrain`` command.

    python benchmarks/planner/plan_nd_gpu.py --mode nd --gpus 8 --out $OUT/nd          # GPUs
    python benchmarks/planner/plan_nd_gpu.py --mode synthesized --gpus 4 --out $OUT/syn
    python benchmarks/planner/plan_nd_gpu.py --mode synthesized --preset cpu-smoke --out /tmp/s

``--mode nd`` (4 or 8 GPUs): ``pipetrain profile --tp 1,2,4[,8]`` (degrees the machine does not
measure are derived: the costs file's ``meta.tp`` says which, and the report repeats it), then
the pp × tp × dp search (``planner.nd_search``, the same as ``pipetrain plan --gpus N
--gpus-per-node N --json``, whose pick is checked to be the same; here every shape is simulated,
``exhaustive``, because the command's bound skips shapes that cannot win but may still lie within
``--near`` of the pick), at a fixed global batch so every shape trains the same tokens a step.
The runs: the pick and every other shape's best plan within ``--near`` (10%) of the pick's
predicted time per global micro-batch.

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
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.planner.plan_nd_launch import Model, equivalence, profile, train_launch
from benchmarks.planner.plan_nd_report import format_report, summarize
from pipetrain.cli.synthesize_command import plan_json
from pipetrain.planner.costs_file import parse_costs
from pipetrain.planner.nd_search import Cluster, NdPlan, nd_search
from pipetrain.planner.synthesize import Synthesis, synthesize

MODES = ("nd", "synthesized")
#: budgets the synthesized mode tries: the planner's unconstrained pick's peak times these
BUDGET_FRACTIONS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)
#: a budget no case reaches: the planner's unconstrained pick
UNBOUNDED_GIB = 1e6

LLAMA_8B_HEAD = dict(model="llama", hidden=2048, heads=16, kv_heads=8, dtype="bfloat16")
PRESETS = {
    "h200": {
        "nd": dict(model=Model(**LLAMA_8B_HEAD, blocks=16, vocab=128256, seq_len=2048,
                               micro_batch_size=1),
                   memory_gib=60.0, global_batch=32, link_gbs=360.0),
        "synthesized": [
            ("heavy head, 128k vocabulary", Model(**LLAMA_8B_HEAD, blocks=16, vocab=128256,
                                                  seq_len=1024, micro_batch_size=2)),
            ("256k vocabulary, tied embedding", Model(**LLAMA_8B_HEAD, blocks=16, vocab=256000,
                                                      seq_len=1024, micro_batch_size=2,
                                                      tie_embeddings=True)),
            ("13 blocks, not divisible by the ranks", Model(**LLAMA_8B_HEAD, blocks=13,
                                                            vocab=128256, seq_len=1024,
                                                            micro_batch_size=2)),
        ],
        "microbatches": 8, "device": "cuda", "warmup": 5, "steps": 20, "launches": 3,
        "launch_s": 420, "repeats": 5,
    },
    "cpu-smoke": {
        "nd": dict(model=Model("llama", blocks=3, hidden=32, heads=2, kv_heads=2, vocab=256,
                               seq_len=32, micro_batch_size=2, dtype="float32"),
                   memory_gib=1.0, global_batch=8, link_gbs=None),
        "synthesized": [
            ("heavy head, 4k vocabulary", Model("llama", blocks=3, hidden=32, heads=2,
                                               kv_heads=2, vocab=4096, seq_len=32,
                                               micro_batch_size=2, dtype="float32")),
        ],
        "microbatches": 4, "device": "cpu", "warmup": 1, "steps": 2, "launches": 1,
        "launch_s": 240, "repeats": 2,
    },
}  # fmt: skip


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, required=True)
    p.add_argument("--preset", choices=PRESETS, default="h200")
    p.add_argument("--gpus", type=int, default=None,
                   help="nd: GPUs to plan for and run on (4 or 8); synthesized: pipeline ranks "
                        "(2 or 4) (default: 8 and 4; cpu-smoke 2 processes)")  # fmt: skip
    p.add_argument("--out", required=True)
    p.add_argument("--near", type=float, default=0.10, help="nd: shapes within this of the pick")
    p.add_argument("--memory-gib", type=float, default=None, help="the budget (default: preset)")
    p.add_argument("--launches", type=int, default=None, help="launches per run (default 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per launch (default 20)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5)")
    p.add_argument("--cases", default=None, help="synthesized: case numbers, e.g. 1,3")
    p.add_argument("--budget-s", type=float, default=3000.0, help="no launch starts after")
    p.add_argument("--resume", action="store_true", help="continue the call in --out")
    args = p.parse_args(argv)
    preset = PRESETS[args.preset]
    for key in ("launches", "steps", "warmup"):
        if getattr(args, key) is None:
            setattr(args, key, preset[key])
    if args.gpus is None:
        args.gpus = 2 if args.preset == "cpu-smoke" else {"nd": 8, "synthesized": 4}[args.mode]
    if args.launches < 1 or args.steps < 1 or args.warmup < 0 or args.gpus < 1:
        p.error("--launches, --steps and --gpus must be >= 1, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    meta = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
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
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=30).stdout.split("\n")  # fmt: skip
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
        costs_json = profile(sys.executable, model, out / "costs.json", device=preset["device"],
                             tp=degrees, link_gbs=spec["link_gbs"], repeats=preset["repeats"])  # fmt: skip
        costs = parse_costs(costs_json)
        meta["tp"] = costs.meta.get("tp")
        cluster = Cluster(gpus=args.gpus, gpus_per_node=args.gpus,
                          link_gbs=spec["link_gbs"] or costs.tp_link_gbs or 100.0,
                          node_link_gbs=25.0)  # fmt: skip
        found = nd_search(costs, cluster, memory_gib=memory, global_batch=spec["global_batch"],
                          micro_batch_size=model.micro_batch_size, exhaustive=True)  # fmt: skip
        meta["memory_gib"], meta["global_batch"] = memory, spec["global_batch"]
        meta["cli_pick"] = cli_pick(out / "costs.json", args.gpus, cluster, memory, spec, model)
        meta["cli_pick_agrees"] = same_layout(meta["cli_pick"], found.best.to_json())
        runs = nd_runs(found.ranked, args.near, out)
        launches = {r["name"]: [] for r in runs}
    measure(args, out, model, runs, launches, meta, started, "nd")
    return 0


def cli_pick(costs: Path, gpus: int, cluster: Cluster, memory: float, spec: dict, model) -> dict:
    """``pipetrain plan --gpus N --gpus-per-node N --json``'s pick, for the same search."""
    argv = [sys.executable, "-m", "pipetrain", "plan", "--costs", str(costs), "--gpus", str(gpus),
            "--gpus-per-node", str(gpus), "--link-gbs", f"{cluster.link_gbs!r}",
            "--memory-gib", f"{memory!r}", "--global-batch", str(spec["global_batch"]),
            "--micro-batch-size", str(model.micro_batch_size), "--json"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-300:]}
    return json.loads(done.stdout)


def same_layout(a: dict, b: dict) -> bool:
    """Whether two plan JSONs carry the same layout (their predictions aside)."""
    return {k: v for k, v in a.items() if k != "predicted"} == {
        k: v for k, v in b.items() if k != "predicted"
    }


def nd_runs(ranked: list[NdPlan], near: float, out: Path) -> list[dict]:
    """The pick and every other shape's best plan within ``near`` of it (per global
    micro-batch), each written as a plan file."""
    pick = ranked[0]
    limit = pick.ms_per_global_microbatch * (1 + near)
    runs = []
    for nd in ranked:
        if nd.ms_per_global_microbatch > limit:
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
                "predicted_behind_pick": nd.ms_per_global_microbatch
                / pick.ms_per_global_microbatch
                - 1,
                "global_microbatches": nd.plan.microbatches * s.dp,
            }
        )
    return runs


def measure(args, out: Path, model: Model, runs: list[dict], launches: dict, meta: dict,
            started: float, mode: str, extra: dict | None = None) -> dict:  # fmt: skip
    """The launches each run lacks, in rotated order, the report rewritten after each."""
    preset = PRESETS[args.preset]
    report: dict = {}
    for k in range(args.launches):
        order = runs[k % len(runs) :] + runs[: k % len(runs)]
        for run in order:
            if len(launches[run["name"]]) > k:
                continue  # measured before a --resume
            if time.monotonic() - started > args.budget_s:
                meta["stopped"] = f"--budget-s {args.budget_s:g} reached in launch {k}"
                break
            folder = out / "launches" / str(k) / slug(run["name"])
            got = train_launch(sys.executable, model, Path(run["plan_file"]), folder,
                               device=preset["device"], warmup=args.warmup, steps=args.steps,
                               limit_s=preset["launch_s"])  # fmt: skip
            got["order"] = order.index(run)
            launches[run["name"]].append(got)
            print(f"launch {k} {run['name']}: " + launch_line(got), flush=True)
            report = write(out, mode, runs, launches, meta, extra)
    report = write(out, mode, runs, launches, meta, extra)
    print(format_report(report), flush=True)
    return report


def launch_line(got: dict) -> str:
    if "error" in got:
        return got["error"][:200]
    steps = sorted(got["steps_ms"])
    return f"median step {steps[len(steps) // 2]:.2f} ms over {len(steps)} steps"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def write(out: Path, mode, runs, launches, meta, extra=None) -> dict:
    """``report.json`` (with what ``--resume`` needs) and ``summary.txt``."""
    report = summarize(mode, runs, launches, meta) | (extra or {})
    saved = report | {"plan_runs": runs, "launches_by_run": launches, "meta": meta}
    (out / "report.json").write_text(json.dumps(saved, indent=1) + "\n")
    (out / "summary.txt").write_text(format_report(report) + "\n")
    return report


def run_synthesized(args: argparse.Namespace, out: Path, meta: dict, started: float) -> int:
    preset = PRESETS[args.preset]
    cases = list(enumerate(preset["synthesized"], start=1))
    if args.cases:
        wanted = {int(c) for c in args.cases.split(",")}
        cases = [c for c in cases if c[0] in wanted]
    failed = 0
    for n, (title, model) in cases:
        folder = out / f"case{n}"
        folder.mkdir(parents=True, exist_ok=True)
        state_file = folder / "report.json"
        if args.resume and state_file.exists():
            saved = json.loads(state_file.read_text())
            runs, launches, case_meta = saved["plan_runs"], saved["launches_by_run"], saved["meta"]
            extra = {"equivalence": saved.get("equivalence"), "budgets": saved.get("budgets")}
        else:
            case_meta = meta | {"case": title, "ranks": args.gpus}
            costs_json = profile(sys.executable, model, folder / "costs.json",
                                 device=preset["device"], repeats=preset["repeats"])  # fmt: skip
            runs, extra = synthesized_runs(args, parse_costs(costs_json), preset, folder)
            case_meta["memory_gib"] = extra["memory_gib"]
            extra["equivalence"] = equivalence(
                sys.executable, Path(runs[0]["plan_file"]), model, folder / "equivalence.json",
                ranks=args.gpus, device=preset["device"],
            )  # fmt: skip
            launches = {r["name"]: [] for r in runs}
        print(f"case {n}: {title}", flush=True)
        measure(args, folder, model, runs, launches, case_meta, started, "synthesized", extra)
        failed += not extra["equivalence"].get("ok")
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
            tried.append((gib, synthesize(costs, num_ranks=args.gpus, num_microbatches=m,
                                          memory_gib=gib)))  # fmt: skip
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
        synth_run(f"planner's best: {base.schedule} v{base.stages_per_rank}", base_file,
                  base.step_ms, m, list(base.stage_layers), "pipetrain.plan's search"),  # fmt: skip
    ]
    budgets_json = [{"memory_gib": g, "speedup": s.speedup, "planner": s.baseline.schedule}
                    for g, s in tried]  # fmt: skip
    return runs, {"memory_gib": gib, "budgets": budgets_json}


def synth_run(name: str, plan_file: Path, step_ms: float, m: int, cut: list, how: str) -> dict:
    return {"name": name, "plan_file": str(plan_file), "predicted_step_ms": step_ms,
            "predicted_pipeline_ms": step_ms, "global_microbatches": m, "stage_layers": cut,
            "how": how}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())

