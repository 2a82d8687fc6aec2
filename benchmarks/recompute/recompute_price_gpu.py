"""What recompute costs one stage, three ways, against what the profiler prices it at (a
benchmark, not a test; docs/planning.md, "Recompute under a replayed step").

A stage of ``--blocks`` blocks of the planner benchmark's GPT (``plan_gpu.PRESETS``) runs
``--microbatches`` forwards then as many backwards (``StageRunner``, the split the runtime
chooses), plain and with every block recomputed (full, selective). Each mode is timed:

* ``eager``: CUDA events around the step;
* ``busy``: the device's busy time under ``torch.profiler`` (with ``kernels``, how many kernels
  and copies ran), and ``device_clock``: what ``profile_clock.DeviceClock`` reads, the busy time
  plus the replay's gap per kernel (``replay_gap_us``, measured as the profiler does on a window
  of blocks, printed first beside the small-kernel chain's ``chain_replay_gap_us``);
* ``graph``: the same step captured as one CUDA graph and replayed (what ``cuda_graph=True`` pays).

Per block and micro-batch, each mode's excess over the plain stage is printed beside the
profiler's ``recompute`` / ``selective_recompute`` of the same block (timed alone, device clock),
so a gap between the price and a replayed step shows in which of the three it arises.

    python3 benchmarks/recompute/recompute_price_gpu.py --out $OUT
    python3 benchmarks/recompute/recompute_price_gpu.py --preset cpu-smoke   # CPU: eager only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.planner.plan_gpu import PRESETS
from pipetrain.app.models.gpt import GPTConfig, gpt_layer
from pipetrain.runtime.backward.activation_checkpoint import Recomputed
from pipetrain.runtime.named_layers import Stage
from pipetrain.runtime.profile.profile_clock import Clock, DeviceClock, busy_us
from pipetrain.runtime.profile.profile_layers import _measure
from pipetrain.runtime.profile.profile_recompute import StageTimer, recompute_times
from pipetrain.runtime.profile.profile_replay import window_work
from pipetrain.runtime.stage import StageRunner

MODES = ("none", "selective", "full")
#: the same stage without pipetrain's runner: torch's checkpoint called directly, backward by
#: ``torch.autograd.backward`` (does the runner add host time of its own?)
RAW_MODES = ("raw-none", "raw-full")


def build(cfg: GPTConfig, blocks: int, mode: str, device, dtype) -> StageRunner:
    layers = [gpt_layer(cfg, 1 + i).to(device=device, dtype=dtype) for i in range(blocks)]
    named = [(f"b{i}", m if mode == "none" else Recomputed(m, mode)) for i, m in enumerate(layers)]
    runner = StageRunner(1, Stage(named), False, None)
    for p in runner.module.parameters():
        p.grad = torch.zeros_like(p)  # kept between steps, as a training loop keeps it
    return runner


def step_fn(runner: StageRunner, x: torch.Tensor, grads: list[torch.Tensor], m: int):
    def step() -> None:
        runner.begin_step()
        for mb in range(m):
            runner.forward(mb, (x,), None, 1.0)
        for mb in range(m):
            runner.backward(mb, [grads[mb]])

    return step


def raw_step_fn(cfg: GPTConfig, blocks: int, mode: str, device, dtype, x, grads, m: int):
    from torch.utils.checkpoint import checkpoint

    layers = [gpt_layer(cfg, 1 + i).to(device=device, dtype=dtype) for i in range(blocks)]
    for p in (p for layer in layers for p in layer.parameters()):
        p.grad = torch.zeros_like(p)

    def step() -> None:
        outs = []
        for _ in range(m):
            h = x.detach().requires_grad_()
            for layer in layers:
                h = layer(h) if mode == "raw-none" else checkpoint(layer, h, use_reentrant=False)
            outs.append(h)
        for mb in range(m):
            torch.autograd.backward(outs[mb], grads[mb])

    return step


def host_calls(step) -> dict:
    """One eager step under torch.profiler: the CUDA runtime calls that wait for the device or
    the allocator (count, host ms), and the host operators with the most self time."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    waits = ("Synchronize", "Malloc", "Free", "Memcpy", "EventQuery", "HostAlloc", "StreamWait")
    calls, top = {}, []
    for e in prof.key_averages():
        if any(w in e.key for w in waits):
            calls[e.key] = [e.count, round(e.cpu_time_total / 1e3, 3)]
        top.append((e.self_cpu_time_total, e.key, e.count))
    top.sort(reverse=True)
    return {"waits": calls, "top_self_cpu": [[k, c, round(t / 1e3, 3)] for t, k, c in top[:12]]}


def timed(fn, clock: Clock, reps: int) -> float:
    return statistics.median(clock.time(fn)[0] for _ in range(reps))


def capture(step) -> torch.cuda.CUDAGraph:
    """``step`` captured as one CUDA graph, after three warm-up steps on a side stream."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def graphed(step, reps: int) -> float:
    graph = capture(step)
    clock = Clock(torch.device("cuda"))
    clock.time(graph.replay)
    return timed(graph.replay, clock, reps)


def lone_prices(cfg: GPTConfig, device, dtype, x: torch.Tensor, clock: Clock) -> dict[str, float]:
    """The profiler's own price of one block's recompute (device clock, timed alone)."""
    layer = gpt_layer(cfg, 1).to(device=device, dtype=dtype)
    timer = StageTimer(_measure, clock, (5, 2, 1), None, None, 3)
    paid, _ = recompute_times([layer], [(x,)], 1, timer)
    plain = timer.times(0, [("layer", layer)], (x,))
    return {"forward": plain[0], "backward": plain[1], **{k: v[0] for k, v in paid.items()}}


def stage_parser(doc: str) -> argparse.ArgumentParser:
    """The options of every one-stage benchmark (this one, ``offload_price_gpu``,
    ``replay_clocks_gpu``): the preset, the stage's blocks and micro-batches, where to write."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="h100")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--out", default="")
    return p


def stage_setup(args: argparse.Namespace):
    """The preset's model config, device and dtype, one micro-batch's input and each
    micro-batch's output gradient (seeded), and the report's header."""
    pre = PRESETS[args.preset]
    cfg = GPTConfig(
        vocab_size=pre["vocab"], seq_len=pre["seq"], num_layers=pre["layers"],
        hidden=pre["hidden"], num_heads=pre["heads"], dropout=0.0, bias=False,
    )  # fmt: skip
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = getattr(torch, pre["dtype"])
    torch.manual_seed(0)
    b, m = pre["mb_size"], args.microbatches
    x = torch.randn(b, cfg.seq_len, cfg.hidden, device=device, dtype=dtype, requires_grad=True)
    grads = [torch.randn_like(x) for _ in range(m)]
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "config": vars(cfg),
                 "blocks": args.blocks, "microbatches": m, "mb_size": b, "modes": {}}  # fmt: skip
    return cfg, device, dtype, x, grads, out


def write_report(folder: str, name: str, out: dict) -> None:
    """``out`` as ``folder/name`` (JSON), where a folder was given (``--out``)."""
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / name).write_text(json.dumps(out, indent=1))


def main() -> int:
    p = stage_parser(__doc__ or "")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    cfg, device, dtype, x, grads, out = stage_setup(args)
    cuda = device.type == "cuda"
    m, k = args.microbatches, args.blocks
    t0 = time.perf_counter()
    clock = DeviceClock(device) if cuda else Clock(device)
    if isinstance(clock, DeviceClock):  # as the profiler does: on a window of real blocks
        out["chain_replay_gap_us"] = clock.replay_gap_us
        blocks = [gpt_layer(cfg, 1 + i).to(device=device, dtype=dtype) for i in range(4)]
        ends = [torch.nn.Identity(), *blocks, torch.nn.Identity()]  # the window leaves out both
        window = window_work(ends, (x.detach(),), context=4, in_flight=4)
        clock.calibrate(*window)  # type: ignore[misc]
        del blocks, window
    out["replay_gap_us"] = getattr(clock, "replay_gap_us", None)
    print(f"replay gap per kernel: {out['replay_gap_us']} µs", flush=True)
    out["lone"] = lone_prices(cfg, device, dtype, x.detach(), clock)
    print(f"profiler, one block alone: {json.dumps(out['lone'])}", flush=True)
    for mode in (*MODES, *RAW_MODES):
        if mode in RAW_MODES:
            runner = None
            step = raw_step_fn(cfg, k, mode, device, dtype, x, grads, m)
        else:
            runner = build(cfg, k, mode, device, dtype)
            step = step_fn(runner, x, grads, m)
        step()
        row = {"eager": timed(step, Clock(device), args.reps)}
        if cuda:
            spans, _ = clock.spans(step)
            row["busy"], row["kernels"] = busy_us(spans) / 1e3, len(spans)
            row["device_clock"] = timed(step, clock, 3)
            row["graph"] = graphed(step, args.reps)
            torch.cuda.synchronize()
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            row["host"] = host_calls(step)
        out["modes"][mode] = row
        print(f"{mode}: {json.dumps(row)}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        del runner, step
        if cuda:
            torch.cuda.empty_cache()
    fields = {"selective": "selective_recompute", "full": "recompute", "raw-full": "recompute"}
    for mode, field in fields.items():
        base = out["modes"]["raw-none" if mode.startswith("raw") else "none"]
        row = out["modes"][mode]
        clocks = ("eager", "busy", "device_clock", "graph")
        per = {c: (row[c] - base[c]) / (k * m) for c in clocks if c in row}
        line = ", ".join(f"{c} {v:.4f}" for c, v in per.items())
        print(f"{mode}: excess per block and micro-batch (ms): {line}; "
              f"profiler's {field} {out['lone'][field]:.4f}", flush=True)  # fmt: skip
        out["modes"][mode]["excess_per_block_mb"] = per
    write_report(args.out, "recompute_price.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
