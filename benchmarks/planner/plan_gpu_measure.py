"""One planned run measured on every rank, for ``plan_gpu.py``: its median step and optimizer
step, its peaks (the step's and the update's apart), the allocator's retries, and one step's
measured timeline explained (``plan_gpu_explain``); a graphed run's timeline from a replay with
timing events."""

from __future__ import annotations

import copy
import gc
import itertools
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.gpu_setup import allocator_counts
from benchmarks.planner.plan_gpu_explain import explain
from pipetrain.app.models.gpt import lm_loss
from pipetrain.planner.layout import Layout

GIB = float(1 << 30)


def measure(run, master, device, x, y, cfg_args, world, costs, run_s: float) -> dict:
    """One run on every rank (``Pipeline.from_plan`` on copies of ``master``); a failure on any
    rank is the run's ``error`` on all."""
    cuda = device.type == "cuda"
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) if cuda else 0
    try:
        mine: object = timed_steps(run, master, device, x, y, cfg_args, base, run_s)
    except Exception as e:  # reported with the run, the other runs go on
        mine = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    finally:
        gc.enable()  # ``--gc-steps`` turned it off while the run stepped
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, mine if isinstance(mine, str) else mine[0])
    errors = [g for g in gathered if isinstance(g, str)]
    if errors:
        return {"error": f"failed: {errors[0]}"}
    steps, (program, timeline) = gathered, mine[1]  # type: ignore[index]
    return {
        "microbatches": run["microbatches"],
        "step_ms": max(g[0] for g in steps),
        "optimizer_ms": max(g[1] for g in steps),
        "peak_gib": [round(g[2], 3) for g in steps],
        # where each rank's peak fell: the pipeline steps, or the optimizer's updates after them
        "peak_step_gib": [round(g[3], 3) for g in steps],
        "peak_update_gib": [round(g[4], 3) for g in steps],
        "allocator_retries": [g[5] for g in steps],
        "device_allocs": [g[6] for g in steps],
        **explain(run, program, timeline, costs),
    }


def timed_steps(run, master, device, x, y, cfg_args, base, run_s: float):
    """This rank's median step and optimizer step (ms) and peak (GiB above ``base``) over the
    preset's steps (fewer, at least 3, where they would take over ``run_s`` seconds), and one
    step's measured timeline with its program."""
    from pipetrain.runtime.pipeline import Pipeline

    cuda = device.type == "cuda"
    layout = Layout.from_json(run)
    graph = bool(cfg_args.get("cuda_graph")) and not layout.offloads

    def build(cuda_graph: bool | str) -> Pipeline:
        return Pipeline.from_plan(
            lambda i: copy.deepcopy(master[i]), layout, lm_loss, device=device,
            timeout=timedelta(minutes=3), cuda_graph=cuda_graph,
        )  # fmt: skip

    pipe = build(graph)
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)

    held = [0.0, 0.0]  # allocated peaks (bytes) of the pipeline steps and of the updates

    gc_steps = cfg_args.get("gc_steps", 0)
    if gc_steps:
        gc.disable()  # enabled again when the run ends (``measure``)
    count = itertools.count(1)

    def step() -> tuple[float, float]:  # ms of the pipeline step and of the optimizer step
        if gc_steps and next(count) % gc_steps == 0:
            gc.collect(1)
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipe.step(x, y)
        if cuda:
            torch.cuda.synchronize()
            held[0] = max(held[0], torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=bool(cfg_args.get("grads_to_none")))
        if cuda:
            torch.cuda.synchronize()
            held[1] = max(held[1], torch.cuda.max_memory_allocated(device))
            torch.cuda.reset_peak_memory_stats(device)
        return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    warm = [sum(step()) for _ in range(cfg_args["warmup"])]
    if graph:  # steps run eagerly until the pipeline captures: warm up through the first replay,
        # so that the timed steps, and their count chosen from the last warm-up step, are replays
        # (an eager selective-recompute step is several times slower than its replay). A replay
        # allocates nothing (its memory is the graph's pool, taken at capture), so the peaks are
        # the capture's and the replays': counted from here
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        held[:] = [0.0, 0.0]
        warm += until_captured(pipe, lambda: sum(step()))
        warm.append(sum(step()))
    # a slow run (an offload the host link cannot hide) times fewer steps; rank 0's last
    # warm-up step decides for all
    steps = [timed_count(cfg_args["steps"], warm, run_s)]
    dist.broadcast_object_list(steps, src=0)
    if not graph:
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        held[:] = [0.0, 0.0]
    before = allocator_counts(device)
    step_times, opt_times = zip(*(step() for _ in range(steps[0])))
    # the caching allocator's retries (a full free and synchronise, then cudaMalloc again) and its
    # cudaMalloc calls during the timed steps: where memory is tight, what a step pays besides work
    after = allocator_counts(device)
    allocs = [a - b for a, b in zip(after, before)]
    step_peak, update_peak = ((h - base) / GIB if cuda else 0.0 for h in held)
    peak = max(step_peak, update_peak)
    program, timeline = timeline_step(pipe, build, graph, x, y)
    medians = [statistics.median(step_times), statistics.median(opt_times)]
    return [*medians, peak, step_peak, update_peak, *allocs], (program, timeline)


def timeline_step(pipe, build, graph: bool, x, y):
    """The run's program and one more step's measured timeline (where a prediction error comes
    from); the pipeline closed after it."""
    # a graphed run's is a replay's, on a pipeline whose graph holds timing events
    # (cuda_graph="timed")
    if graph:
        pipe.close()
        try:
            pipe = build("timed")
            until_captured(pipe, lambda: pipe.step(x, y))
            # replays back to back first: the capture leaves the device cool, at a clock the
            # timed steps (back to back) do not run at (docs/planning.md, sustained load)
            for _ in range(SETTLE_REPLAYS):
                pipe.step(x, y)
            pipe.step(x, y, timeline=True)
        except Exception as e:  # every rank hears of a failure: all take the eager timeline
            print(f"a timed replay failed ({type(e).__name__}: {e}); eager timeline", flush=True)
            pipe.close()
            pipe = build(False)
            pipe.step(x, y)
            pipe.step(x, y, timeline=True)
    else:
        pipe.step(x, y, timeline=True)
    program, timeline = pipe.program, pipe.last_timeline
    pipe.close()
    return program, timeline


def timed_count(steps: int, warm: list[float], run_s: float) -> int:
    """The preset's steps, fewer (at least 3) where they would take over ``run_s`` seconds at
    the last warm-up step's pace."""
    return min(steps, max(3, int(run_s * 1e3 / warm[-1]))) if warm and warm[-1] > 0 else steps


#: replays run back to back before a graphed run's timed replay, so that it runs at the clock the
#: timed steps ran at (a GPU at its power limit lowers it within about a tenth of a second)
SETTLE_REPLAYS = 3


def until_captured(pipe, step) -> list:
    """Run ``step`` until ``pipe`` has captured its graph (rank 0 decides for all: every rank
    steps as often); the results of the steps run."""
    from pipetrain.runtime.cuda_graph import WARMUP

    out = []
    for _ in range(3 * WARMUP + 2):
        captured = [pipe.graph is not None and pipe.graph.captured]
        dist.broadcast_object_list(captured, src=0)
        if captured[0]:
            break
        out.append(step())
    return out
