"""The planner on GPUs (docs/planning.md, "Proof on GPUs"): profile a Llama-3-shaped GPT, plan it
under three memory budgets, then measure each pick against its alternatives. A benchmark, not a
test.

    torchrun --nproc-per-node 2 benchmarks/planner/plan_gpu.py --out $OUT                 # GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/planner/plan_gpu.py --preset cpu-smoke --out /tmp/p  # CPU

(any number of ranks: the plans are made for the process group's size; on 2 × H100 the default
run takes about 6 minutes, ``--budget-s`` stopping new runs after 360 s.)

1. Rank 0 profiles the model's layers (``pipetrain.profile``: embedding, each block, head with the
   loss) on its GPU, in the dtype of the run, AdamW state counted as static memory: the times,
   activations and, for recompute and offload, what full and selective recompute hold and add to
   each backward and the host bandwidth (``host_bandwidth_gbs``, measured on CUDA; the CPU smoke
   run times a host memory copy in its place, so offload is planned there too). With
   ``--cuda-graph`` the times are the GPU's busy time alone (``timing="device"``), what a replayed
   step pays.
2. Rank 0 plans (``pipetrain.planner.search``) under a generous, a tight and a memory-bound budget
   (``plan_gpu_variants``: which budgets, which runs per budget — the pick, the uniform 1F1B
   cuts, for the memory-bound one the pick's cut with every recompute and offload variant, near
   candidates).
3. Every rank then measures each distinct run with ``Pipeline.from_plan`` (the plan's cut,
   schedule, recompute and offload, on copies of layers built once per rank), the memory-bound
   budget's runs first, in ``--rounds`` rounds; each run keeps its fastest round (the same
   program measured up to 12% apart between two rounds of one invocation). Per run: the pipeline
   step time (``synchronize`` + ``perf_counter`` around ``Pipeline.step``, slowest rank, median of
   the timed steps; the AdamW step timed apart, since the simulator does not model it) and each
   rank's peak allocated memory (``max_memory_allocated`` over the timed steps, optimizer step
   included, above what was allocated before the stages were built; also the pipeline steps'
   and the updates' peaks apart, ``peak_step_gib`` and ``peak_update_gib``). No run starts after
   ``--budget-s`` seconds; the report is rewritten after every run.

Reported (``plan_gpu_report``): per run predicted / measured step and peak per rank, runs over
budget, each stage's mean action over its price; per budget regret and whether the targets hold. Writes ``plan_gpu.json`` (everything),
``costs.json`` and ``summary.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.planner.plan_gpu_explain import best_round
from benchmarks.planner.plan_gpu_measure import measure
from benchmarks.planner.plan_gpu_report import resummarize, summarize, write
from benchmarks.planner.plan_gpu_variants import BUDGETS, given_budget, plan_budgets, run_key
from pipetrain.app.models.gpt import GPTConfig, gpt_layer, gpt_layer_names, lm_loss
from pipetrain.planner import ModelCosts, parse_costs
from pipetrain.planner.layout import Layout, default_cut

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


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="h100", choices=PRESETS)
    p.add_argument("--out", required=True)
    p.add_argument("--budgets", default=",".join(BUDGETS), help="which, comma-separated")
    p.add_argument("--generous-gib", type=float, default=70.0)
    p.add_argument("--tight-fraction", type=float, default=0.85, help="of 1F1B's lowest peak")
    p.add_argument("--bound-fraction", type=float, default=0.5,
                   help="memory-bound usable memory: this far from full recompute's lowest peak "
                        "to the lowest peak without recompute or offload")  # fmt: skip
    p.add_argument("--near", type=float, default=0.10)
    p.add_argument("--max-near", type=int, default=3, help="near candidates per budget at most")
    p.add_argument("--headroom", type=float, default=None, help="planner headroom (its default)")
    p.add_argument("--context", type=int, default=4, help="profiler window (layers)")
    p.add_argument("--rounds", type=int, default=2, help="times each run is measured")
    p.add_argument("--budget-s", type=float, default=360.0,
                   help="no run starts after this many seconds (s, default 360)")  # fmt: skip
    p.add_argument("--run-s", type=float, default=5.0,
                   help="a run's timed steps take about this long at most (s, default 5; at "
                        "least 3 steps)")  # fmt: skip
    p.add_argument("--cuda-graph", action="store_true",
                   help="time each run as Pipeline(cuda_graph=True) where it does not offload "
                        "(its timeline step then runs on an eager pipeline)")  # fmt: skip
    p.add_argument("--grads-to-none", action="store_true",
                   help="zero gradients with set_to_none=True between steps (default: keep .grad, "
                        "set_to_none=False, which a replayed graph adds into in place)")  # fmt: skip
    p.add_argument(
        "--host-action-ms",
        type=float,
        default=None,
        help="the runtime's host time per action besides its issue, for the eager host "
        "model (costs file host_action_ms; a measured run prints it as 'host between "
        "actions')",
    )
    p.add_argument(
        "--gc-steps",
        type=int,
        default=0,
        help="0: Python's automatic garbage collection; N: off while a run steps, a "
        "young-generation collection every N steps (torchtitan's gc_freq recipe)",
    )
    p.add_argument(
        "--calibrate-host",
        action="store_true",
        help="eager: measure uniform 1F1B once before planning and take the runtime's "
        "host time between actions (host_action_ms) from it",
    )
    p.add_argument("--resummarize", metavar="JSON", help="rewrite summary.txt from plan_gpu.json")
    p.add_argument("--runs", metavar="JSON",
                   help="measure these layouts instead of planning: {\"memory_gib\", \"headroom\", "
                        "\"runs\": [layouts]}, predicted from --costs (no profile)")  # fmt: skip
    p.add_argument("--costs", metavar="FILE", help="with --runs: the costs file to predict from")
    args = p.parse_args()
    if args.runs and not args.costs:
        p.error("--runs needs --costs (the costs file the layouts are predicted from)")
    args.budgets = [b for b in args.budgets.split(",") if b]
    bad = sorted(set(args.budgets) - set(BUDGETS))
    if bad:
        p.error(f"--budgets: unknown {bad}; legal: {', '.join(BUDGETS)}")
    return args


def main() -> int:
    args = arguments()
    if args.resummarize:
        return resummarize(Path(args.resummarize))
    cuda = torch.cuda.is_available() and args.preset != "cpu-smoke"
    cfg_args = {**PRESETS[args.preset], "cuda_graph": args.cuda_graph and cuda,
                "grads_to_none": args.grads_to_none,
                **({"gc_steps": args.gc_steps} if args.gc_steps else {})}  # fmt: skip
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

    # every run's stages are copies of these, built once: initialising the embedding or the head
    # takes seconds on one core, longer than a run on the GPUs (in threads: torch's kernels let
    # go of the GIL, and the values come from each layer's own seeded generator)
    with ThreadPoolExecutor(max(1, (os.cpu_count() or 1) // world)) as pool:
        master = list(pool.map(lambda i: gpt_layer(cfg, i).to(dtype), range(cfg.num_layers + 2)))
    log(f"built {len(master)} layers on the host")
    b = cfg_args["mb_size"]
    counts = [int(m) for m in cfg_args["microbatches"].split(",")]

    # 1. profile (rank 0), 2. plan (rank 0), then share the runs
    info = share(rank, lambda: first_costs(args, cfg, master, dtype, device, b, cfg_args))
    if "error" in info:
        log(f"stopped: {info['error']}")
        dist.destroy_process_group()
        return 1
    costs = captured_if(parse_costs(info["costs"]), cfg_args)
    if not args.runs:
        log(f"profiled {costs.num_layers} layers, host {costs.host_bandwidth_gbs or 0:.1f} GB/s")
    if args.calibrate_host and not cuda:
        log("--calibrate-host: nothing to calibrate on a CPU (its host is its device)")
    elif args.calibrate_host and not cfg_args["cuda_graph"]:
        costs = calibrated(costs, cfg, master, device, b, cfg_args, world, max(counts), args.run_s)
        log(f"the runtime's host time between actions on this host: {costs.host_action_ms:.3f} ms")
    info = share(rank, lambda: {"costs": costs.to_json(), "budgets": [
        given_budget(costs, json.loads(Path(args.runs).read_text()))] if args.runs
        else plan_budgets(costs, world, counts, args)})  # fmt: skip
    if "error" in info:
        log(f"stopped: {info['error']}")
        dist.destroy_process_group()
        return 1
    if rank == 0:
        (out / "costs.json").write_text(json.dumps(costs.to_json(), indent=1) + "\n")
        log("planned: " + "; ".join(plan_line(x) for x in info["budgets"]))
    costs = captured_if(parse_costs(info["costs"]), cfg_args)
    budgets = info["budgets"]
    measure_runs(args, cfg, cfg_args, master, device, costs, budgets, log, started)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def measure_runs(
    args: argparse.Namespace,
    cfg: GPTConfig,
    cfg_args: dict,
    master: list,
    device: torch.device,
    costs: ModelCosts,
    budgets: list[dict],
    log: Callable[[str], None],
    started: float,
) -> None:
    """Measure every distinct run, round after round, in budget order (the memory-bound one
    first), until ``--budget-s``; rank 0 rewrites the report after each run."""
    out = Path(args.out)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    b, rank, world = cfg_args["mb_size"], dist.get_rank(), dist.get_world_size()

    # 3. measure every distinct run (in budget order: the memory-bound one first)
    distinct = {run_key(run): run for budget in budgets for run in budget["runs"]}
    rounds: dict[str, list[dict]] = {key: [] for key in distinct}
    progress = {"rounds": args.rounds, "budget_s": args.budget_s, "stopped": None,
                "cuda_graph": cfg_args["cuda_graph"]}  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    for r in range(args.rounds):
        for i, (key, run) in enumerate(distinct.items()):
            go = [time.perf_counter() - started < args.budget_s]
            dist.broadcast_object_list(go, src=0)  # rank 0's clock decides for all
            if not go[0]:
                progress["stopped"] = f"--budget-s {args.budget_s:g} reached in round {r}"
                break
            total_mb = run["microbatches"] * b
            x = torch.randint(0, cfg.vocab_size, (total_mb, cfg.seq_len), generator=gen)
            y = torch.randint(0, cfg.vocab_size, (total_mb, cfg.seq_len), generator=gen)
            m = measure(run, master, device, x.to(device), y.to(device), cfg_args, world, costs,
                        args.run_s)  # fmt: skip
            rounds[key].append(m)
            log(f"round {r} run {i + 1}/{len(distinct)} {key}: " + progress_line(run, m))
            if rank == 0:
                results = {k: best_round(ms) for k, ms in rounds.items() if ms}
                report = summarize(costs.meta, budgets, results, progress)
                write(out, report, cfg_args, world, name)
        if progress["stopped"]:
            log(f"stopped: {progress['stopped']}")
            break
    if rank == 0:
        results = {k: best_round(ms) for k, ms in rounds.items() if ms}
        report = summarize(costs.meta, budgets, results, progress)
        write(out, report, cfg_args, world, name, echo=True)


def share(rank: int, make) -> dict:
    """``make()`` on rank 0, broadcast to every rank; a failure there is every rank's ``error``
    (the others would otherwise wait in the broadcast)."""
    shared: list[object] = [None]
    if rank == 0:
        try:
            shared[0] = make()
        except Exception as e:
            shared[0] = {"error": f"{type(e).__name__}: {e}"}
    dist.broadcast_object_list(shared, src=0)
    return shared[0]  # type: ignore[return-value]


def captured_if(costs, cfg_args: dict):
    """``costs`` as a step captured as a CUDA graph runs them, where the runs are graphed
    (recomputing stages split their backward: ``ModelCosts.captured``)."""
    return costs.for_captured_step() if cfg_args["cuda_graph"] else costs


def first_costs(args, cfg, master, dtype, device, b: int, cfg_args: dict) -> dict:
    """The costs runs are predicted from: ``--costs`` with ``--runs`` (no profile, no plan: the
    layouts given), else a fresh profile."""
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.runs:
        costs = parse_costs(json.loads(Path(args.costs).read_text()))
    else:
        timing = "device" if cfg_args["cuda_graph"] else "wall"
        costs = profile_model(cfg, master, dtype, device, b, cfg_args["repeats"], args.context,
                              timing)  # fmt: skip
    if args.host_action_ms is not None:
        costs = dataclasses.replace(costs, host_action_ms=args.host_action_ms)
    return {"costs": costs.to_json()}


def calibrated(costs, cfg, master, device, b: int, cfg_args, world: int, count: int, run_s):
    """``costs`` with ``host_action_ms`` read off uniform 1F1B measured once on this host (every
    rank): the runtime's mean host time between actions, which an eager step pays per action
    and the profiler's lone stages do not (posting transfers, bookkeeping)."""
    cut = default_cut(costs.num_layers - 2, world)
    run = Layout(schedule="1f1b", ranks=world, stages_per_rank=1, microbatches=count,
                 stage_layers=tuple(cut)).to_json()  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, cfg.vocab_size, (count * b, cfg.seq_len), generator=gen).to(device)
            for _ in range(2))  # fmt: skip
    m = measure(run, master, device, x, y, cfg_args, world, costs, run_s)
    between = m.get("host_between_ms")
    if not between:
        raise RuntimeError(f"calibrating the host model: uniform 1F1B gave no host spans ({m})")
    return dataclasses.replace(costs, host_action_ms=statistics.fmean(between))


def plan_line(budget: dict) -> str:
    return f"{budget['budget']} {budget['memory_gib']:.4g} GiB: {len(budget['runs'])} runs, pick {run_key(budget['runs'][0])}"  # fmt: skip


def progress_line(run: dict, m: dict) -> str:
    if "error" in m:
        return m["error"]
    ratio = run["predicted_step_ms"] / m["step_ms"]
    peaks = ", ".join(f"{p:.2f}" for p in m["peak_gib"])
    line = f"{m['step_ms']:.1f} ms (predicted / measured {ratio:.3f}), peak GiB [{peaks}]"
    if any(m.get("allocator_retries", ())) or any(m.get("device_allocs", ())):
        line += f", allocator retries {m['allocator_retries']}, cudaMalloc {m['device_allocs']}"
    return line


def profile_model(cfg: GPTConfig, master, dtype, device, b: int, repeats: int, context: int, timing: str = "wall") -> ModelCosts:  # fmt: skip
    from pipetrain.runtime.profile.profile_layers import profile

    layers = [copy.deepcopy(m).to(device) for m in master]
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen).to(device)
    costs = profile(
        layers, tokens, loss_fn=lm_loss, target=targets, optimizer="adamw", repeats=repeats,
        context=context, timing=timing,
        names=gpt_layer_names(cfg), meta={"model": "llama-shaped gpt", "config": vars(cfg),
                                          "micro_batch_size": b, "dtype": str(dtype)},
    )  # fmt: skip
    del layers
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    else:  # the profiler measures the host link on CUDA only; here "host memory" is the device
        meta = {**costs.meta, "host_bandwidth": "cpu-smoke: a host memory copy, timed"}
        costs = dataclasses.replace(costs, host_bandwidth_gbs=host_copy_gbs(), meta=meta)
    return costs


def host_copy_gbs(nbytes: int = 1 << 24, repeats: int = 5) -> float:
    """GB/s of a copy in host memory (the CPU smoke run's stand-in for the host link)."""
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


if __name__ == "__main__":
    code = main()
    # Every rank has met in the last barrier and the report is written. Leave without the
    # interpreter's teardown, which frees torch's C++ objects (process groups, their threads) in
    # no defined order: in the CPU smoke run a rank aborted there once ("terminate called
    # without an active exception", 2026-11-28) after its work was done. The library's own exit
    # is tested apart (tests/runtime/test_runtime_exit.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
