"""Where each rank's device time goes in pipetrain's steps, from torch.profiler; a diagnostic.

    torchrun --nproc-per-node 2 benchmarks/pipeline/profile_pipeline_gpu.py --out OUT \
        --schedules 1f1b,interleaved-1f1b --microbatches 16 [--trace-rank 1]

Same model, stages and optimizer as ``gpu_pipeline.py`` (its presets). Per schedule: warm-up steps,
then ``--profile-steps`` steps (pipeline step + optimizer step) under ``torch.profiler`` with CPU
and CUDA activities. Per rank, from the kernels' device intervals:

* device time of kernels by kind — GEMM, attention, NCCL, other (by kernel name);
* how much of the compute kernels' time ran while an NCCL kernel was resident on the same GPU
  (a receive posted early is a kernel that waits on the device: it holds SMs while compute runs);
* the window (first kernel start to last kernel end) and the idle time inside it;
* the ten kernels with the most device time.

Writes ``profile.json`` (every rank) and, with ``--trace-rank R``, rank R's Chrome trace gzipped
(``trace_rank{R}_{schedule}.json.gz``; open in Perfetto). Without CUDA only the CPU side exists
and the kernel columns stay empty (a smoke run of the plumbing).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.gpu_setup import (
    FAMILIES,
    PRESETS,
    Ctx,
    make_optimizer,
    make_pipeline,
    opt_step,
)

KINDS = ("gemm", "attention", "nccl", "other")


def kind_of(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if any(k in low for k in ("gemm", "nvjet", "cutlass", "xmma", "cublas")):
        return "gemm"
    if any(k in low for k in ("flash", "fmha", "attention", "sdpa")):
        return "attention"
    return "other"


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def overlap(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """Total length of ``intervals`` inside the (merged, sorted) ``cover``."""
    total, j = 0.0, 0
    for a, b in sorted(intervals):
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            total += max(0.0, min(b, cover[k][1]) - max(a, cover[k][0]))
            k += 1
    return total


def summarise(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """``kernels``: (name, start µs, end µs) of one rank's device kernels; per-step ms."""
    if not kernels:
        return {"kernels": 0}
    by_kind = dict.fromkeys(KINDS, 0.0)
    by_name: dict[str, list[float]] = {}
    nccl, compute = [], []
    for name, a, b in kernels:
        k = kind_of(name)
        by_kind[k] += b - a
        slot = by_name.setdefault(name, [0.0, 0])
        slot[0] += b - a
        slot[1] += 1
        (nccl if k == "nccl" else compute).append((a, b))
    window = max(b for _, _, b in kernels) - min(a for _, a, _ in kernels)
    busy = sum(b - a for a, b in merged([(a, b) for _, a, b in kernels]))
    compute_busy = sum(b - a for a, b in merged(compute))
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:10]
    ms = 1e-3 / steps
    return {
        "kernels": len(kernels) // steps,
        "window_ms": window * ms,
        "idle_ms": (window - busy) * ms,
        "compute_busy_ms": compute_busy * ms,
        "kernel_ms": {k: v * ms for k, v in by_kind.items()},
        "compute_under_nccl_ms": overlap(compute, merged(nccl)) * ms,
        "top": [(n[:90], t * ms, c // steps) for n, (t, c) in top],
    }


def device_kernels(prof) -> list[tuple[str, float, float]]:
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if getattr(e, "is_user_annotation", False):
            continue  # a span such as "nccl:recv 0<-1" over its kernel, not a kernel
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start:
            out.append((e.name, float(e.time_range.start), float(e.time_range.end)))
    return out


def profile_schedule(ctx: Ctx, name: str, n: int, args) -> dict:
    from torch.profiler import ProfilerActivity, profile

    pipe = make_pipeline(ctx, name, n, 60.0)
    params = list(pipe.parameters())
    opt = make_optimizer(ctx, params)
    x, y = ctx.batch(n)
    for _ in range(args.warmup):
        pipe.step(x, y)
        opt_step(opt, params)
    ctx.sync()
    dist.barrier()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(args.profile_steps):
            pipe.step(x, y)
            opt_step(opt, params)
        ctx.sync()
    row = {"schedule": name, "microbatches": n, "rank": ctx.rank}
    row.update(summarise(device_kernels(prof), args.profile_steps))
    if args.out and args.trace_rank == ctx.rank:
        out = Path(args.out) / f"trace_rank{ctx.rank}_{name}.json.gz"
        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            with raw.open("rb") as src, gzip.open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
    del pipe, opt, params
    return row


def table(rows: list[dict]) -> str:
    lines = [
        "| schedule | mb | rank | window ms | idle ms | GEMM ms | attention ms | NCCL ms | "
        "other ms | compute busy ms | compute under NCCL ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.get("kernels"):
            lines.append(
                f"| {r['schedule']} | {r['microbatches']} | {r['rank']} | no CUDA kernels |"
            )
            continue
        k = r["kernel_ms"]
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['rank']} | {r['window_ms']:.1f} | "
            f"{r['idle_ms']:.1f} | {k['gemm']:.1f} | {k['attention']:.1f} | {k['nccl']:.1f} | "
            f"{k['other']:.1f} | {r['compute_busy_ms']:.1f} | {r['compute_under_nccl_ms']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: h100 on GPU")
    p.add_argument("--schedules", default="1f1b,interleaved-1f1b")
    p.add_argument("--microbatches", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--trace-rank", type=int, default=-1, help="rank whose trace to write")
    p.add_argument("--out", default=None)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--pg-timeout", type=float, default=120.0)
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    args = p.parse_args(argv)
    preset = args.preset or ("h100" if torch.cuda.is_available() else "cpu-smoke")
    for k, v in PRESETS[preset].items():
        if k not in ("warmup", "microbatches"):
            setattr(args, k, v)
    names = [s for s in args.schedules.split(",") if s]
    bad = [s for s in names if s not in FAMILIES]
    if bad:
        raise SystemExit(f"unknown schedules {bad}; legal: {', '.join(FAMILIES)}")
    ctx = Ctx(args)
    if args.out and ctx.rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    dist.barrier()
    rows = []
    for name in names:
        mine = profile_schedule(ctx, name, args.microbatches, args)
        rows += [r for r in ctx.gather(mine)]
    if ctx.rank == 0:
        device = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu"
        print(
            f"## profile: {device} × {ctx.world}, torch {torch.__version__}, per step", flush=True
        )
        print(table(rows), flush=True)
        for r in rows:
            for n, ms, count in r.get("top", [])[:5]:
                print(f"rank {r['rank']} {r['schedule']}: {ms:8.2f} ms  ×{count:<5} {n}")
        if args.out:
            (Path(args.out) / "profile.json").write_text(json.dumps(rows, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
