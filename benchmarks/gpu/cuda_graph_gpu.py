"""Whole-step CUDA graphs on GPUs: exact against eager steps, and how much faster (docs/benchmarks.md).

    torchrun --nproc-per-node 2 benchmarks/gpu/cuda_graph_gpu.py --part exact --out $OUT
    torchrun --nproc-per-node 2 benchmarks/gpu/cuda_graph_gpu.py --part speed --out $OUT

``exact``: per schedule, two pipelines of the same float64 GPT (one ``cuda_graph=True``) step the
same batches — a token-mean loss whose counted tokens change every step (so the loss weights
change under the graph), AdamW between steps, ``zero_grad()`` after most steps, none after one (so
gradients accumulate across steps) and ``zero_grad(set_to_none=False)`` after another — and every
loss, gradient and updated parameter is compared: largest relative error (‖a − b‖ / ‖b‖), which
must be ≤ 1e-12; the graphed pipeline must have replayed every step after its warm-up.

``speed``: per shape and schedule, the same bf16 GPT with and without ``cuda_graph=True``, the
same fused AdamW step, ``rounds`` alternating rounds (eager first in even rounds) of warm-up then
``steps`` timed steps (``synchronize`` + ``perf_counter`` around step and optimizer, the slowest
rank's); ratio eager / graph of the mean of round medians with a 95% bootstrap interval over
rounds and steps (``intervals.ratio_interval``). ``small`` is host-bound (hidden 1024, seq 512,
micro-batch 1, 32 micro-batches); ``large`` is the app's 8 × 2048 GPT (seq 1024, micro-batch 4,
8 micro-batches).
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from intervals import ratio_interval

from pipetrain.app.models.gpt import GPTConfig, make_stage
from pipetrain.runtime.losses import TokenCrossEntropy
from pipetrain.runtime.pipeline import Pipeline

V = {"1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}
SHAPES = {
    "small": (
        GPTConfig(vocab_size=32000, seq_len=512, num_layers=8, hidden=1024, num_heads=16),
        1,
        32,
    ),
    "large": (
        GPTConfig(vocab_size=32000, seq_len=1024, num_layers=8, hidden=2048, num_heads=16),
        4,
        8,
    ),
}


def log(msg: str, every_rank: bool = False) -> None:
    if every_rank or dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')} r{dist.get_rank()}] {msg}", flush=True)


def p2p_probe(device) -> dict:
    """Sends and receives on two groups, captured in a CUDA graph and replayed: what the
    pipeline's transfers need from NCCL under capture, alone."""
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    up, down = dist.new_group([0, 1]), dist.new_group([0, 1])
    send = torch.full((4,), float(rank + 1), device=device)
    recv = torch.zeros(4, device=device)

    def exchange() -> None:
        first, second = (up, down) if rank == 0 else (down, up)
        w1 = (
            dist.isend(send, other, group=first)
            if rank == 0
            else dist.irecv(recv, other, group=second)
        )
        w2 = (
            dist.irecv(recv, other, group=second)
            if rank == 0
            else dist.isend(send, other, group=first)
        )
        w1.wait()
        w2.wait()
        recv.mul_(2)

    exchange()
    torch.cuda.synchronize()
    log("probe: eager exchange done", True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
        exchange()
    log("probe: captured", True)
    send.fill_(float(10 * (rank + 1)))
    graph.replay()
    torch.cuda.synchronize()
    log(f"probe: replayed, received {recv.tolist()}", True)
    return {"ok": recv.tolist() == [20.0 * (other + 1)] * 4, "received": recv.tolist()}


def split_name(name: str) -> tuple[str, dict]:
    """``NAME+overlap``: ``overlap_pairs=True``; ``NAME+replayw``: ``defer_weight_grads=False``."""
    options: dict = {}
    for suffix, option, value in (
        ("+replayw", "defer_weight_grads", False),
        ("+overlap", "overlap_pairs", True),
    ):
        if name.endswith(suffix):
            name, options[option] = name.removesuffix(suffix), value
    return name, options


def pipeline(stages, name: str, n: int, device, **options) -> Pipeline:
    base, more = split_name(name)
    v, world = V[base], dist.get_world_size()
    return Pipeline(
        stages,
        base,
        n,
        TokenCrossEntropy(),
        stages_per_rank=v,
        num_stages=v * world,
        device=device,
        timeout=timedelta(seconds=120),
        **more,
        **options,
    )


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).norm().item() / (b.norm().item() or 1.0)


def exact(name: str, device) -> dict:
    base, _ = split_name(name)
    world, n = dist.get_world_size(), 8
    v = V[base]
    cfg = GPTConfig(vocab_size=256, seq_len=32, num_layers=2 * v * world, hidden=64, num_heads=4)
    num_stages = v * world
    eager_stages = {s: make_stage(cfg, s, num_stages, seed=3).double() for s in range(num_stages)}
    graph_stages = {s: copy.deepcopy(m) for s, m in eager_stages.items()}
    eager = pipeline(lambda s: eager_stages[s], name, n, device)
    graphed = pipeline(lambda s: graph_stages[s], name, n, device, cuda_graph=True)
    opts = [torch.optim.AdamW(p.parameters(), lr=1e-2, foreach=True) for p in (eager, graphed)]
    gen = torch.Generator().manual_seed(11)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    steps = 6
    for step in range(steps):
        x = torch.randint(0, 256, (2 * n, cfg.seq_len), generator=gen)
        y = torch.randint(0, 256, (2 * n, cfg.seq_len), generator=gen)
        y[torch.rand(y.shape, generator=gen) < 0.1 * (step + 1)] = -100  # counts change
        losses = [p.step(x, y) for p in (eager, graphed)]
        log(f"{name} step {step}: losses {[v.item() for v in losses]}", True)
        worst["loss"] = max(
            worst["loss"], abs(losses[1].item() - losses[0].item()) / abs(losses[0].item())
        )
        pairs = list(zip(eager.parameters(), graphed.parameters()))
        for a, b in pairs:
            if (a.grad is None) != (b.grad is None):
                raise AssertionError(f"step {step}: a gradient is None on one pipeline only")
            if a.grad is not None:
                worst["grad"] = max(worst["grad"], rel(b.grad, a.grad))
        for opt in opts:
            opt.step()
        for opt in opts:
            if step == 2:
                continue  # gradients accumulate into step 3
            opt.zero_grad(set_to_none=step != 4)
        for a, b in pairs:
            worst["param"] = max(worst["param"], rel(b.detach(), a.detach()))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (worst, graphed.graph.replays))
    out = {k: max(w[k] for w, _ in everyone) for k in worst}
    out["replays"] = [r for _, r in everyone]
    out["ok"] = max(out[k] for k in worst) <= 1e-12 and all(r == steps - 2 for r in out["replays"])
    eager.close()
    graphed.close()
    return out


def timed(pipe: Pipeline, opt, batch, count: int, device) -> list[float]:
    x, y = batch
    times = []
    for _ in range(count):
        torch.cuda.synchronize(device)
        t = time.perf_counter()
        pipe.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        dt = torch.tensor([time.perf_counter() - t], device=device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item() * 1e3)
    return times


def speed(shape: str, name: str, device, rounds: int, steps: int) -> dict:
    cfg, mb, n = SHAPES[shape]
    base, _ = split_name(name)
    num_stages = V[base] * dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (mb * n, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (mb * n, cfg.seq_len), generator=gen)
    rows = {}
    for label, graph in (("eager", False), ("graph", True)):
        stages = lambda s: make_stage(cfg, s, num_stages, seed=0).to(device, torch.bfloat16)  # noqa: E731
        pipe = pipeline(stages, name, n, device, cuda_graph=graph)
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-5, fused=True)
        rows[label] = (pipe, opt)
    got: dict[str, list[list[float]]] = {"eager": [], "graph": []}
    first: dict[str, float] = {}
    for r in range(rounds):
        order = ("eager", "graph") if r % 2 == 0 else ("graph", "eager")
        for label in order:
            pipe, opt = rows[label]
            warm = timed(pipe, opt, (x, y), 4, device)
            first.setdefault(label, sum(warm[:3]))
            got[label].append(timed(pipe, opt, (x, y), steps, device))
    peak = torch.cuda.max_memory_allocated(device) / 2**30
    iv = ratio_interval(got["eager"], got["graph"])
    out = {
        "eager_ms": statistics.fmean(statistics.median(s) for s in got["eager"]),
        "graph_ms": statistics.fmean(statistics.median(s) for s in got["graph"]),
        "speedup": None if iv is None else [iv.estimate, iv.low, iv.high],
        "first_three_steps_ms": first,
        "replays": rows["graph"][0].graph.replays,
        "peak_gib_both": peak,
        "steps": got,
    }
    for pipe, _ in rows.values():
        pipe.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("probe", "exact", "speed", "all"), default="all")
    p.add_argument("--stacks-after", type=float, default=0, help="dump every thread's stack (s)")
    p.add_argument(
        "--schedules",
        default="1f1b,interleaved-1f1b,zb-h1,interleaved-zb,zbv,zbv+replayw,dualpipev,dualpipev+overlap",
    )
    p.add_argument("--speed-schedules", default="1f1b,interleaved-1f1b,zbv,dualpipev")
    p.add_argument("--shapes", default="small,large")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", timeout=timedelta(seconds=180), device_id=device)
    if a.stacks_after:
        faulthandler.dump_traceback_later(a.stacks_after, exit=True)
    results: dict = {"exact": {}, "speed": {}}
    out = Path(a.out) if a.out else None

    def save() -> None:
        if out is not None and dist.get_rank() == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "cuda_graph_gpu.json").write_text(json.dumps(results, indent=1))

    if a.part == "probe":
        results["probe"] = p2p_probe(device)
        log(f"probe: {results['probe']}")
        save()
    if a.part in ("exact", "all"):
        for name in a.schedules.split(","):
            try:
                results["exact"][name] = exact(name, device)
            except Exception as e:  # a failing schedule is a row, the others still run
                results["exact"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
            log(f"exact {name}: {results['exact'][name]}")
            save()
    if a.part in ("speed", "all"):
        for shape in a.shapes.split(","):
            for name in a.speed_schedules.split(","):
                try:
                    row = speed(shape, name, device, a.rounds, a.steps)
                except Exception as e:
                    row = {"error": f"{type(e).__name__}: {e}"[:300]}
                results["speed"][f"{shape}/{name}"] = row
                short = {k: v for k, v in row.items() if k != "steps"}
                log(f"speed {shape}/{name}: {short}")
                save()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
