"""Where a graphed step's time goes outside its replay (a benchmark, not a test;
docs/planning.md, "Where the recomputing runs' excess arises").

A graphed pipeline step (``Pipeline(cuda_graph=True)``) is one replay plus host work around it:
splitting the batch, checking the step's key, copying the batch into the static buffers, the
agreement's store write, then, after the replay, handing the gradients over and sharing the
loss. The planner predicts the replay alone. This times, per rank and step: the host before the
graph's launch, the launch call, the graph on the device (CUDA events around the launch), the
device work after it (the loss's broadcast) and the whole step (``synchronize`` and
``perf_counter`` around ``Pipeline.step``, as ``plan_gpu.py`` times it). Then one profiled step's
host operators. The model is ``plan_gpu.py``'s GPT (16 blocks, hidden 2048, vocabulary 128256,
sequence 1024, micro-batches of 2), cut evenly, 1F1B, 16 micro-batches.

    torchrun --nproc-per-node 2 benchmarks/host/graph_step_gaps.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.app.models.gpt import GPTConfig, lm_loss, make_stage
from pipetrain.runtime.pipeline import Pipeline


def instrument(pipe: Pipeline) -> dict:
    """Wrap the captured graph's ``replay`` so each step notes when it was launched and records
    CUDA events around it; returns the dict the wrapper fills."""
    graph: Any = pipe.graph._graph  # type: ignore[union-attr]  # a diagnostic reaches inside
    replay = graph.replay
    marks: dict = {}

    def timed_replay() -> None:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks["launch_at"] = time.perf_counter()
        begin.record()
        replay()
        end.record()
        marks["launched"] = time.perf_counter()
        marks["events"] = (begin, end)

    graph.replay = timed_replay
    return marks


def one_step(pipe: Pipeline, x, y, marks: dict) -> dict[str, float]:
    dist.barrier()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    done = torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    pipe.step(x, y)
    done.record()
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    begin, end = marks["events"]
    return {
        "before_launch": 1e3 * (marks["launch_at"] - t0),
        "launch_call": 1e3 * (marks["launched"] - marks["launch_at"]),
        "device_idle_before_graph": start.elapsed_time(begin),
        "graph_device": begin.elapsed_time(end),
        "after_graph_device": end.elapsed_time(done),
        "step": 1e3 * (t1 - t0),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=16)
    a = p.parse_args()
    dist.init_process_group("nccl", timeout=timedelta(minutes=3))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    cfg = GPTConfig(vocab_size=128256, seq_len=1024, num_layers=16, hidden=2048, num_heads=16)
    gen = torch.Generator().manual_seed(0)
    shape = (2 * a.microbatches, cfg.seq_len)
    x = torch.randint(0, cfg.vocab_size, shape, generator=gen).to(device)
    y = torch.randint(0, cfg.vocab_size, shape, generator=gen).to(device)
    pipe = Pipeline(
        lambda s: make_stage(cfg, s, world, seed=0).to(device, torch.bfloat16),
        "1f1b", a.microbatches, lm_loss, num_stages=world, device=device, cuda_graph=True,
        timeout=timedelta(minutes=2),
    )  # fmt: skip
    params = list(pipe.parameters())
    for _ in range(4):  # eager warm-up, then the capture and its first replay
        pipe.step(x, y)
        for q in params:
            q.grad = None
    if rank == 0:
        print(f"warmed up, {pipe.graph.replays} replay(s)", flush=True)  # type: ignore[union-attr]
    marks = instrument(pipe)
    rows = []
    for _ in range(a.steps):
        rows.append(one_step(pipe, x, y, marks))
        for q in params:
            q.grad = None
    mine = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    )
    with prof:
        one_step(pipe, x, y, marks)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, {"rank": rank, "median_ms": mine, "host": host})
    if rank == 0:
        for r in everyone:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in r["median_ms"].items())
            print(f"rank {r['rank']}: {parts}", flush=True)
        print(everyone[0]["host"], flush=True)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / "graph_step_gaps.json").write_text(json.dumps(everyone, indent=1))
            prof.export_chrome_trace(str(Path(a.out) / "trace-r0.json.gz"))
    pipe.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
