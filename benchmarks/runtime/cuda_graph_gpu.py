"""Whole-step CUDA graphs on GPUs: exact against eager steps, and how much faster (docs/benchmarks.md).

    torchrun --nproc-per-node 2 benchmarks/runtime/cuda_graph_gpu.py --part exact --out $OUT
    torchrun --nproc-per-node 2 benchmarks/runtime/cuda_graph_gpu.py --part speed --out $OUT
    torchrun --nproc-per-node 2 benchmarks/runtime/cuda_graph_gpu.py --part timeline --out $OUT

``exact``: per schedule, two pipelines of the same float64 GPT (one ``cuda_graph=True``) step the
same batches — a token-mean loss whose counted tokens change every step (so the loss weights
change under the graph), AdamW between steps, gradients set to ``None``, zeroed in place
(``set_to_none=False``) or kept (accumulating across steps) after each (``AFTER_STEP``: graphs
captured with ``.grad`` absent and kept) — and every loss, gradient and updated parameter is
compared: largest relative error (‖a − b‖ / ‖b‖), which must be ≤ 1e-12; the graphed pipeline
must have replayed the steps ``AFTER_STEP`` says it does.

``speed``: per shape and schedule, the same bf16 GPT with and without ``cuda_graph=True``, the
same fused AdamW step, ``rounds`` alternating rounds (eager first in even rounds) of warm-up then
``steps`` timed steps (``synchronize`` + ``perf_counter`` around step and optimizer, the slowest
rank's); ratio eager / graph of the mean of round medians with a 95% bootstrap interval over
rounds and steps (``intervals.ratio_interval``). ``small`` is host-bound (hidden 1024, seq 512,
micro-batch 1, 32 micro-batches); ``large`` is the app's 8 × 2048 GPT (seq 1024, micro-batch 4,
8 micro-batches). Per variant also its memory: the allocated peak above what was allocated before
its steps, and how far its steps grew the reserved memory (a graph's pool is reserved once;
replays allocate nothing). ``--variants graph`` (or ``eager``) builds one variant alone: its
memory without the other pipeline beside it.

``timeline``: per schedule, the large shape's bf16 GPT as ``cuda_graph=True``, as
``cuda_graph="timed"`` (timing events inside the graph) and eagerly: the step with and without the
events (``steps`` timed replays each), and one timed replay's ``Timeline`` against an eager
step's — every compute action of every rank spanned in both (``same_actions``), the replay's
spans inside its step, and the mean action per (kind, stage) each way.

``probe``: sends and receives between neighbours on two groups, captured and replayed — NCCL
under capture without the pipeline (any number of ranks). ``--allow-expandable`` lifts the
runtime's refusal of expandable allocator segments (diagnosis only: a replayed step hung with
them); with ``--stacks-after S`` every rank prints its threads' stacks after S seconds and exits,
so a hang shows where it waits.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.intervals import ratio_interval
from benchmarks.runtime.gpu_equivalence import split_name
from pipetrain.app.models.gpt import GPTConfig, make_stage
from pipetrain.runtime import cuda_graph
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
    """Each rank sends to its higher neighbour on one group and to its lower on another, as the
    pipeline's transfers do, captured in a CUDA graph and replayed: what they need from NCCL
    under capture, alone (any number of ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    everyone = list(range(world))
    up, down = dist.new_group(everyone), dist.new_group(everyone)
    send = torch.full((4,), float(rank + 1), device=device)
    from_below, from_above = torch.zeros(4, device=device), torch.zeros(4, device=device)

    def exchange() -> None:
        works = []
        if rank + 1 < world:
            works.append(dist.isend(send, rank + 1, group=up))
        if rank > 0:
            works.append(dist.irecv(from_below, rank - 1, group=up))
        if rank > 0:
            works.append(dist.isend(send, rank - 1, group=down))
        if rank + 1 < world:
            works.append(dist.irecv(from_above, rank + 1, group=down))
        for w in works:
            w.wait()
        from_below.mul_(2)
        from_above.mul_(2)

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
    got = (from_below.tolist(), from_above.tolist())
    log(f"probe: replayed, received {got}", True)
    want_below = [20.0 * rank] * 4 if rank > 0 else [0.0] * 4
    want_above = [20.0 * (rank + 2)] * 4 if rank + 1 < world else [0.0] * 4
    ok = torch.tensor(float(got == (want_below, want_above)), device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return {"ok": bool(ok.item()), "received": got}


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


#: what the exact check does to gradients after each step: ``none`` zero_grad() (set to None),
#: ``zero`` zero_grad(set_to_none=False), ``keep`` nothing (they accumulate into the next step).
#: Steps 0, 1 warm up; 2 captures with every .grad None and replays (its buffers become .grad);
#: kept, they give step 3 another key (copied out, warm-up at 3 and 4); 5 captures with .grad
#: kept and replays, adding into it, as do 6–8 (6's accumulate into 7); None again at 9: eager
AFTER_STEP = {0: "none", 1: "none", 2: "keep", 3: "zero", 4: "zero", 5: "zero", 6: "keep",
              7: "zero", 8: "none"}  # fmt: skip
REPLAYS = 5  # steps 2, 5, 6, 7, 8


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
    steps = len(AFTER_STEP) + 1
    for step in range(steps):
        x = torch.randint(0, 256, (2 * n, cfg.seq_len), generator=gen)
        y = torch.randint(0, 256, (2 * n, cfg.seq_len), generator=gen)
        y[
            torch.rand(y.shape, generator=gen) < 0.08 * (step + 1)
        ] = -100  # counts change (never all)
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
            if AFTER_STEP.get(step, "keep") != "keep":
                opt.zero_grad(set_to_none=AFTER_STEP[step] == "none")
        for a, b in pairs:
            worst["param"] = max(worst["param"], rel(b.detach(), a.detach()))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (worst, graphed.graph.replays))
    out = {k: max(w[k] for w, _ in everyone) for k in worst}
    out["replays"] = [r for _, r in everyone]
    out["ok"] = max(out[k] for k in worst) <= 1e-12 and all(r == REPLAYS for r in out["replays"])
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


def speed(shape: str, name: str, device, rounds: int, steps: int, variants: list[str]) -> dict:
    cfg, mb, n = SHAPES[shape]
    base, _ = split_name(name)
    num_stages = V[base] * dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (mb * n, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (mb * n, cfg.seq_len), generator=gen)
    rows = {}
    for label in variants:
        stages = lambda s: make_stage(cfg, s, num_stages, seed=0).to(device, torch.bfloat16)  # noqa: E731
        pipe = pipeline(stages, name, n, device, cuda_graph=label == "graph")
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-5, fused=True)
        rows[label] = (pipe, opt)
    got: dict[str, list[list[float]]] = {label: [] for label in variants}
    first: dict[str, float] = {}
    # memory of each variant's steps above what is allocated before them: the graph's pool is
    # reserved once and replays allocate nothing, so the reserved growth is its cost
    memory: dict[str, dict[str, float]] = {label: {} for label in variants}
    for r in range(rounds):
        for label in variants if r % 2 == 0 else variants[::-1]:
            pipe, opt = rows[label]
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
            torch.cuda.reset_peak_memory_stats(device)
            warm = timed(pipe, opt, (x, y), 4, device)
            first.setdefault(label, sum(warm[:3]))
            got[label].append(timed(pipe, opt, (x, y), steps, device))
            seen = memory[label]
            peak = (torch.cuda.max_memory_allocated(device) - before[0]) / 2**30
            grown = (torch.cuda.memory_reserved(device) - before[1]) / 2**30
            seen["peak_allocated_above_gib"] = max(seen.get("peak_allocated_above_gib", 0), peak)
            seen["reserved_growth_gib"] = max(seen.get("reserved_growth_gib", 0), grown)
    out = {
        f"{label}_ms": statistics.fmean(statistics.median(s) for s in got[label])
        for label in variants
    }
    if len(variants) == 2:
        iv = ratio_interval(got["eager"], got["graph"])
        out["speedup"] = None if iv is None else [iv.estimate, iv.low, iv.high]
    out.update(first_three_steps_ms=first, memory=memory, steps=got)
    if "graph" in rows:
        out["replays"] = rows["graph"][0].graph.replays
    for pipe, _ in rows.values():
        pipe.close()
    return out


def replay_timeline(name: str, device, steps: int) -> dict:
    from pipetrain.sim.costs import mean_durations

    cfg, mb, n = SHAPES["large"]
    base, _ = split_name(name)
    num_stages = V[base] * dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (mb * n, cfg.seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (mb * n, cfg.seq_len), generator=gen)
    out: dict = {}
    timelines = {}
    for label, mode in (("graph", True), ("timed", "timed"), ("eager", False)):
        stages = lambda s: make_stage(cfg, s, num_stages, seed=0).to(device, torch.bfloat16)  # noqa: E731
        pipe = pipeline(stages, name, n, device, cuda_graph=mode)
        opt = torch.optim.AdamW(list(pipe.parameters()), lr=1e-5, fused=True)
        timed(pipe, opt, (x, y), 4, device)  # two eager steps, then the capture and its replay
        out[f"{label}_ms"] = statistics.median(timed(pipe, opt, (x, y), steps, device))
        if mode is not True:
            pipe.step(x, y, timeline=True)
            timelines[label] = pipe.last_timeline
            opt.zero_grad(set_to_none=True)
        if mode:
            out[f"{label}_replays"] = pipe.graph.replays
        pipe.close()
        log(f"timeline {name} {label}: {out[f'{label}_ms']:.1f} ms", True)
    replay, eager = timelines["timed"], timelines["eager"]
    spanned = [sorted((s.rank, str(s.action)) for s in t.spans) for t in (replay, eager)]
    out["same_actions"] = spanned[0] == spanned[1]
    out["spans_inside_step"] = all(0 <= s.start <= s.end <= out["timed_ms"] for s in replay.spans)
    out["replay_makespan_ms"], out["eager_makespan_ms"] = replay.makespan, eager.makespan
    means = [mean_durations([t]) for t in (replay, eager)]
    out["mean_action_ms"] = {
        f"{kind.name}{stage}": [round(means[0].get((kind, stage), 0), 3), round(m, 3)]
        for (kind, stage), m in sorted(means[1].items(), key=lambda kv: (kv[0][1], kv[0][0].name))
    }
    out["ok"] = out["same_actions"] and out["spans_inside_step"]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("probe", "exact", "speed", "timeline", "all"), default="all")
    p.add_argument("--stacks-after", type=float, default=0, help="dump every thread's stack (s)")
    p.add_argument(
        "--schedules",
        default="1f1b,interleaved-1f1b,zb-h1,interleaved-zb,zbv,zbv+replayw,dualpipev,dualpipev+overlap",
    )
    p.add_argument("--speed-schedules", default="1f1b,interleaved-1f1b,zbv,dualpipev")
    p.add_argument("--shapes", default="small,large")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--variants", default="eager,graph", help="eager, graph or both (a ratio)")
    p.add_argument(
        "--allow-expandable",
        action="store_true",
        help="diagnosis only: let cuda_graph=True run with expandable allocator segments",
    )
    p.add_argument("--out", default=None)
    a = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", timeout=timedelta(seconds=180), device_id=device)
    if a.allow_expandable:
        cuda_graph.expandable_segments = lambda: False
        log(f"DIAGNOSIS: allocator settings {os.environ.get('PYTORCH_CUDA_ALLOC_CONF')} allowed")
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
                    variants = a.variants.split(",")
                    row = speed(shape, name, device, a.rounds, a.steps, variants)
                except Exception as e:
                    row = {"error": f"{type(e).__name__}: {e}"[:300]}
                results["speed"][f"{shape}/{name}"] = row
                short = {k: v for k, v in row.items() if k != "steps"}
                log(f"speed {shape}/{name}: {short}")
                save()
    if a.part == "timeline":
        for name in a.speed_schedules.split(","):
            try:
                results.setdefault("timeline", {})[name] = replay_timeline(name, device, a.steps)
            except Exception as e:
                results.setdefault("timeline", {})[name] = {
                    "error": f"{type(e).__name__}: {e}"[:300]
                }
            log(f"timeline {name}: {results['timeline'][name]}")
            save()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
