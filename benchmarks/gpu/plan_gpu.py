"""The planner on GPUs (docs/planning.md): profile a Llama-3-shaped GPT, plan it under two memory
budgets, then measure the pick against the usual cuts. A benchmark, not a test.

    torchrun --nproc-per-node 4 benchmarks/gpu/plan_gpu.py --out $OUT                 # GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/gpu/plan_gpu.py --preset cpu-smoke --out /tmp/p  # CPU

1. Rank 0 profiles the model's layers (``pipetrain.profile``: embedding, each block, head with the
   loss) on its GPU, in the dtype of the run, AdamW state counted as static memory.
2. Rank 0 plans (``pipetrain.planner.search``) under a generous budget and under a tight one that
   forbids the smallest peak any 1F1B candidate reaches (``--tight-fraction`` of it).
3. Every rank then measures, with ``pipetrain.Pipeline`` on stages cut by the plans'
   ``stage_layers`` (``gpt_stage``): for each budget the pick, (a) the uniform split of the
   blocks with 1F1B (embedding on the first stage, head on the last), (b) torchtitan's rule with
   1F1B (the embedding and the head count as one layer each: the uniform split of the whole
   list), (c) every other fitting candidate within 10% of the pick in simulation. Per run: the
   pipeline step time (``synchronize`` + ``perf_counter`` around ``Pipeline.step``, slowest rank,
   median of the timed steps; the AdamW step is timed apart, since the simulator does not model
   it) and each rank's peak allocated memory (``max_memory_allocated`` over the timed steps,
   optimizer step included, above what was allocated before the stages were built).

Reported: regret (measured step of the pick / best measured step - 1, among every run of the
call whose measured peak fits the budget),
runs whose measured peak exceeds the budget ("OOM" against the budget; the GPUs themselves have
more memory, so nothing actually runs out), predicted vs measured step and peak per rank, and
the pick's speed-up over (a) and (b). Writes ``plan_gpu.json`` (everything), ``costs.json``
and ``summary.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pipetrain.app.models.gpt import GPTConfig, gpt_layer_names, gpt_layers, gpt_stage, lm_loss
from pipetrain.planner import ModelCosts, parse_costs, search
from pipetrain.planner.layout import default_cut
from pipetrain.planner.partition import uniform_cut
from pipetrain.planner.search import simulate_plan, stage_costs
from pipetrain.runtime.profile_layers import RATIO_OF, TIMES
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.costs import mean_durations, measured_costs
from pipetrain.sim.simulate import simulate

PRESETS = {
    # Llama-3-8B's vocabulary and head/embedding shape at a smaller depth and width
    "h100": dict(
        vocab=128256, seq=1024, layers=16, hidden=2048, heads=16, mb_size=2,
        dtype="bfloat16", microbatches="8,16", steps=10, warmup=2, repeats=5,
    ),
    "cpu-smoke": dict(
        vocab=512, seq=64, layers=6, hidden=32, heads=2, mb_size=4,
        dtype="float32", microbatches="4", steps=2, warmup=1, repeats=2,
    ),
}  # fmt: skip
GIB = float(1 << 30)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="h100", choices=PRESETS)
    p.add_argument("--out", required=True)
    p.add_argument("--generous-gib", type=float, default=70.0)
    p.add_argument("--tight-fraction", type=float, default=0.85)
    p.add_argument("--near", type=float, default=0.10)
    p.add_argument("--max-runs", type=int, default=6, help="runs measured per budget at most")
    p.add_argument("--headroom", type=float, default=None, help="planner headroom (its default)")
    p.add_argument("--context", type=int, default=4, help="profiler window (layers)")
    p.add_argument("--rounds", type=int, default=2, help="times each run is measured")
    p.add_argument("--resummarize", metavar="JSON", help="rewrite summary.txt from plan_gpu.json")
    args = p.parse_args()
    cfg_args = PRESETS[args.preset]
    if args.resummarize:
        return resummarize(Path(args.resummarize))
    cuda = torch.cuda.is_available() and args.preset != "cpu-smoke"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timedelta(minutes=10), device_id=device)
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, cfg_args["dtype"])
    cfg = GPTConfig(
        vocab_size=cfg_args["vocab"],
        seq_len=cfg_args["seq"],
        num_layers=cfg_args["layers"],
        hidden=cfg_args["hidden"],
        num_heads=cfg_args["heads"],
        bias=False,
    )
    out = Path(args.out)
    started = time.perf_counter()

    def log(msg: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - started:6.1f}s] {msg}", flush=True)

    gen = torch.Generator().manual_seed(0)
    b, t = cfg_args["mb_size"], cfg.seq_len
    counts = [int(m) for m in cfg_args["microbatches"].split(",")]

    # 1. profile (rank 0), 2. plan (rank 0), then share the runs
    shared: list[object] = [None]
    if rank == 0:
        try:  # a failure here must reach the other ranks, or they wait in the broadcast
            out.mkdir(parents=True, exist_ok=True)
            costs = profile_model(cfg, dtype, device, b, cfg_args["repeats"], args.context)
            (out / "costs.json").write_text(json.dumps(costs.to_json(), indent=1) + "\n")
            log(f"profiled {costs.num_layers} layers")
            shared[0] = {"costs": costs.to_json(), "budgets": plan_runs(costs, world, counts, args)}
            log("planned")
        except Exception as e:
            shared[0] = {"error": f"{type(e).__name__}: {e}"}
    dist.broadcast_object_list(shared, src=0)
    info = shared[0]
    if "error" in info:
        log(f"stopped: {info['error']}")
        dist.destroy_process_group()
        return 1
    costs = parse_costs(info["costs"])
    budgets = info["budgets"]

    # 3. measure every distinct run, in ``--rounds`` rounds (one program's speed varied between
    # two rounds of one invocation, docs/planning.md: each run keeps its best round)
    distinct = {run_key(run): run for budget in budgets for run in budget["runs"]}
    rounds: dict[str, list[dict]] = {key: [] for key in distinct}
    for r in range(args.rounds):
        for key, run in distinct.items():
            total_mb = run["microbatches"] * b
            x = torch.randint(0, cfg.vocab_size, (total_mb, t), generator=gen).to(device)
            y = torch.randint(0, cfg.vocab_size, (total_mb, t), generator=gen).to(device)
            m = measure(run, cfg, dtype, device, x, y, cfg_args, rank, world, costs)
            rounds[key].append(m)
            log(f"round {r}: {key}: {m['step_ms']:.1f} ms, peak {m['peak_gib']}")
    results = {key: best_round(ms) for key, ms in rounds.items()}

    if rank == 0:
        report = summarize(costs.meta, budgets, results)
        name = torch.cuda.get_device_name(device) if cuda else "cpu"
        report.update(cfg_args=cfg_args, world=world, device=name, rounds=args.rounds)
        (out / "plan_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
        text = format_summary(report, cfg_args, world, name)
        (out / "summary.txt").write_text(text + "\n")
        print(text, flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def profile_model(cfg: GPTConfig, dtype, device, b: int, repeats: int, context: int) -> ModelCosts:
    from pipetrain.runtime.profile_layers import profile

    layers = [m.to(device=device, dtype=dtype) for m in gpt_layers(cfg)]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen).to(device)
    costs = profile(
        layers, tokens, loss_fn=lm_loss, target=targets, optimizer="adamw", repeats=repeats,
        context=context,
        names=gpt_layer_names(cfg), meta={"model": "llama-shaped gpt", "config": vars(cfg),
                                          "micro_batch_size": b, "dtype": str(dtype)},
    )  # fmt: skip
    del layers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return costs


def plan_runs(costs: ModelCosts, world: int, counts: list[int], args) -> list[dict]:
    """The two budgets, each with the runs to measure (pick, baselines, near candidates)."""
    room = {} if args.headroom is None else {"headroom": args.headroom}
    generous = search(
        costs, num_ranks=world, memory_gib=args.generous_gib, microbatches=counts, **room
    )
    one_f_one_b = [c for c in generous.candidates if c.plan.schedule == "1f1b"]
    lowest_1f1b = min(max(c.plan.peak_gib) for c in one_f_one_b)
    # the tightest budget below 1F1B's lowest peak at which some plan still fits
    for fraction in (args.tight_fraction, 0.9, 0.95, 0.98):
        tight_gib = fraction * lowest_1f1b
        tight = search(costs, num_ranks=world, memory_gib=tight_gib, microbatches=counts, **room)
        if tight.fitting:
            break
    else:  # none below 1F1B's lowest peak: just above the lowest peak the generous search saw
        # (its candidate is evaluated again under any budget: the first cuts do not depend on it)
        lowest = min(max(c.plan.peak_gib) for c in generous.candidates)
        tight_gib = lowest / (1 - generous.candidates[0].plan.headroom) * 1.001
        tight = search(costs, num_ranks=world, memory_gib=tight_gib, microbatches=counts, **room)
    budgets = []
    for label, found, gib in (
        ("generous", generous, args.generous_gib),
        ("tight", tight, tight_gib),
    ):
        pick = found.best.plan
        runs = [as_run(pick, "pick")]
        n = costs.num_layers
        for role, cut in (
            ("uniform-1f1b", default_cut(n - 2, world)),
            ("torchtitan-1f1b", uniform_cut(n, world)),
        ):
            program = build_schedule("1f1b", world, pick.microbatches)
            timeline, peaks = simulate_plan(costs, program, cut)
            runs.append({
                "role": role, "schedule": "1f1b", "stages_per_rank": 1,
                "microbatches": pick.microbatches, "stage_layers": list(cut),
                "predicted_step_ms": timeline.makespan, "predicted_peak_gib": list(peaks),
            })  # fmt: skip
        for c in found.near(args.near)[1:]:
            if len(runs) >= args.max_runs:
                break
            runs.append(as_run(c.plan, "near"))
        budgets.append({"budget": label, "memory_gib": gib, "usable_gib": pick.usable_gib,
                        "pick": pick.to_json(), "runs": runs})  # fmt: skip
    return budgets


def as_run(plan, role: str) -> dict:
    return {
        "role": role, "schedule": plan.schedule, "stages_per_rank": plan.stages_per_rank,
        "microbatches": plan.microbatches, "stage_layers": list(plan.stage_layers),
        "predicted_step_ms": plan.step_ms, "predicted_peak_gib": list(plan.peak_gib),
    }  # fmt: skip


def run_key(run: dict) -> str:
    cut = ",".join(map(str, run["stage_layers"]))
    return f"{run['schedule']}/v{run['stages_per_rank']}/M{run['microbatches']}/{cut}"


def lone_costs(costs: ModelCosts) -> ModelCosts:
    """The costs as the layers measured alone (the profiler's window ratios undone)."""
    layers = list(costs.layers)
    for w in costs.meta.get("context", {}).get("windows", []):
        for i in range(w["first"], w["end"]):
            layers[i] = dataclasses.replace(
                layers[i], **{k: getattr(layers[i], k) / w[RATIO_OF[k]] for k in TIMES}
            )
    return dataclasses.replace(costs, layers=tuple(layers))


def measure(run, cfg, dtype, device, x, y, cfg_args, rank, world, costs) -> dict:
    from pipetrain.runtime.pipeline import Pipeline

    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    cut = run["stage_layers"]

    def stage(s: int):  # built on the CPU (seeded per part), moved by Pipeline
        return gpt_stage(cfg, cut, s).to(dtype=dtype)

    pipe = Pipeline(
        stage, run["schedule"], run["microbatches"], lm_loss,
        stages_per_rank=run["stages_per_rank"], num_stages=len(cut) if run["schedule"] != "dualpipe" else 2 * len(cut),
        device=device, timeout=timedelta(minutes=3),
    )  # fmt: skip
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
    step_times, opt_times = [], []
    for i in range(cfg_args["warmup"] + cfg_args["steps"]):
        if i == cfg_args["warmup"] and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipe.step(x, y)
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= cfg_args["warmup"]:
            step_times.append((t1 - t0) * 1e3)
            opt_times.append((t2 - t1) * 1e3)
    peak = (torch.cuda.max_memory_allocated(device) - base) / GIB if cuda else 0.0
    mine = torch.tensor([statistics.median(step_times), statistics.median(opt_times), peak])
    gathered = [torch.zeros(3) for _ in range(world)]
    dist.all_gather_object(gathered, mine.tolist())
    # Where a prediction error comes from: one step with the measured timeline; its mean action
    # per (kind, stage) against the costs file's stage sums, and the program simulated with its
    # own measured means (right there: the schedule model holds and the stage costs are off).
    pipe.step(x, y, timeline=True)
    measured_tl = pipe.last_timeline
    program = pipe.program
    del pipe, opt, params
    means = mean_durations([measured_tl])
    own = simulate(program, measured_costs([measured_tl], program.num_stages)).makespan
    predicted = stage_costs(costs, program, run["stage_layers"])
    lone = stage_costs(lone_costs(costs), program, run["stage_layers"])
    per_stage = []
    for s in range(program.num_stages):
        row = {"stage": s}
        for kind, attr in ((OpKind.F, "forward"), (OpKind.B, "backward"),
                           (OpKind.I, "backward_input"), (OpKind.W, "backward_weight")):  # fmt: skip
            if (kind, s) in means:
                row[attr] = {"measured": means[kind, s], "predicted": getattr(predicted, attr)[s],
                             "alone": getattr(lone, attr)[s]}  # fmt: skip
        per_stage.append(row)
    return {
        "microbatches": run["microbatches"],
        "step_ms": max(g[0] for g in gathered),
        "optimizer_ms": max(g[1] for g in gathered),
        "peak_gib": [round(g[2], 3) for g in gathered],
        "timeline_step_ms": measured_tl.makespan,
        "simulated_with_own_means_ms": own,
        "predicted_from_lone_layers_ms": simulate(program, lone).makespan,
        "stages": per_stage,
    }


def best_round(measured: list[dict]) -> dict:
    """A run's fastest round (its timeline and stages with it), every round's step, the highest
    peak of any round."""
    best = min(measured, key=lambda m: m["step_ms"])
    peaks = [max(m["peak_gib"][r] for m in measured) for r in range(len(best["peak_gib"]))]
    return {**best, "peak_gib": peaks, "rounds_step_ms": [m["step_ms"] for m in measured]}


def resummarize(path: Path) -> int:
    """The summary again from a saved ``plan_gpu.json`` (after a change to what it reports)."""
    saved = json.loads(path.read_text())
    budgets = [{k: v for k, v in b.items() if k != "runs"} for b in saved["budgets"]]
    results = {}
    for budget, saved_budget in zip(budgets, saved["budgets"]):
        budget["runs"] = []
        for run in saved_budget["runs"]:
            measured = run["measured"]
            measured.setdefault("microbatches", run["microbatches"])
            results[run_key(run)] = measured
            budget["runs"].append(
                {k: v for k, v in run.items() if k not in ("measured", "over_budget")}
            )
    report = summarize(saved["costs_meta"], budgets, results)
    report.update({k: saved[k] for k in ("cfg_args", "world", "device", "rounds") if k in saved})
    path.write_text(json.dumps(report, indent=1) + "\n")
    text = format_summary(
        report, saved.get("cfg_args", {}), saved.get("world"), saved.get("device")
    )
    (path.parent / "summary.txt").write_text(text + "\n")
    print(text)
    return 0


def summarize(costs_meta: dict, budgets, results) -> dict:
    """Regret is per micro-batch (a run's step / its micro-batches: the costs file fixes the
    micro-batch size) against every run of the call whose measured peak fits the budget."""
    report = {"costs_meta": dict(costs_meta), "budgets": []}
    for budget in budgets:
        runs = []
        for run in budget["runs"]:
            measured = results[run_key(run)]
            runs.append({**run, "measured": measured,
                         "over_budget": max(measured["peak_gib"]) > budget["memory_gib"]})  # fmt: skip
        pick = runs[0]

        # regret against every run of this call that fit this budget when measured (the other
        # budget's runs included), and the pick itself
        def per_mb(m: dict) -> float:
            return m["step_ms"] / m["microbatches"]

        fitting = [
            per_mb(m) for m in results.values() if max(m["peak_gib"]) <= budget["memory_gib"]
        ]
        best = min([per_mb(pick["measured"]), *fitting])
        by_role = {r["role"]: r for r in runs}
        pick_ms = pick["measured"]["step_ms"]
        report["budgets"].append({
            "budget": budget["budget"], "memory_gib": budget["memory_gib"], "pick": budget["pick"],
            "regret": per_mb(pick["measured"]) / best - 1,
            "step_error": pick["predicted_step_ms"] / pick_ms - 1,
            "peak_error": [p / m - 1 if m else None for p, m in
                           zip(pick["predicted_peak_gib"], pick["measured"]["peak_gib"])],
            "speedup_over_uniform": by_role["uniform-1f1b"]["measured"]["step_ms"] / pick_ms,
            "speedup_over_torchtitan": by_role["torchtitan-1f1b"]["measured"]["step_ms"] / pick_ms,
            "pick_over_budget": pick["over_budget"],
            "pick_rounds_step_ms": pick["measured"].get("rounds_step_ms"),
            "runs": runs,
        })  # fmt: skip
    return report


def format_summary(report, cfg_args, world, name) -> str:
    lines = [f"{world} x {name}; model {cfg_args}"]
    for b in report["budgets"]:
        lines.append(
            f"\nbudget {b['budget']} ({b['memory_gib']:.2f} GiB): regret {b['regret']:+.1%}, "
            f"pick step predicted/measured - 1 = {b['step_error']:+.1%}, speed-up over uniform "
            f"{b['speedup_over_uniform']:.3f}x, over torchtitan {b['speedup_over_torchtitan']:.3f}x, "
            f"pick over budget: {b['pick_over_budget']}"
        )
        if b.get("pick_rounds_step_ms"):
            rounds = ", ".join(f"{x:.1f}" for x in b["pick_rounds_step_ms"])
            lines.append(f"pick's rounds: {rounds} ms (the best is reported)")
        lines.append(
            f"{'role':<16} {'run':<40} {'pred ms':>9} {'meas ms':>9} {'alone ms':>9} "
            f"{'own ms':>8} {'opt ms':>7}  pred / meas GiB per rank"
        )
        for r in b["runs"]:
            m = r["measured"]
            peaks = " ".join(
                f"{p:.2f}/{q:.2f}" for p, q in zip(r["predicted_peak_gib"], m["peak_gib"])
            )
            flag = " OVER" if r["over_budget"] else ""
            lines.append(
                f"{r['role']:<16} {run_key(r):<40} {r['predicted_step_ms']:9.1f} "
                f"{m['step_ms']:9.1f} {m['predicted_from_lone_layers_ms']:9.1f} "
                f"{m['simulated_with_own_means_ms']:8.1f} {m['optimizer_ms']:7.1f}  {peaks}{flag}"
            )
    lines.append(
        "\nalone ms: the prediction from the layers timed alone (before the profiler's window "
        "scaling); own ms: the program simulated with its own measured mean action times"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
