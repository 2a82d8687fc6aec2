"""Set-up shared by ``gpu_pipeline.py``'s parts: the schedule families and presets, the process
context (device, process group, seeded stage copies, batches, memory readings) and step timing.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain.app.models.gpt import GPTConfig, lm_loss, make_stage

GIB = 2**30


@dataclass(frozen=True)
class Family:
    torch_class: str
    stages_per_rank: int
    layout: str  # "one", "loop", "v"


FAMILIES = {
    "gpipe": Family("ScheduleGPipe", 1, "one"),
    "1f1b": Family("Schedule1F1B", 1, "one"),
    "interleaved-1f1b": Family("ScheduleInterleaved1F1B", 2, "loop"),
    "looped-bfs": Family("ScheduleLoopedBFS", 2, "loop"),
    "interleaved-zb": Family("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": Family("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": Family("ScheduleDualPipeV", 2, "v"),
}

PRESETS = {
    # the reference shape: 16 layers × hidden 2048, seq 1024, micro-batch 4, bf16
    "h100": dict(
        vocab=8192,
        seq=1024,
        layers=16,
        hidden=2048,
        heads=16,
        mb_size=4,
        dtype="bfloat16",
        microbatches="16,8",
        steps=10,
        warmup=3,
        timeline_steps=2,
        limit_steps=6,
        budget_s=300.0,
    ),
    "cpu-smoke": dict(
        vocab=256,
        seq=64,
        layers=8,
        hidden=64,
        heads=4,
        mb_size=2,
        dtype="float32",
        microbatches="",  # 2 × ranks, so the V schedules (micro-batches >= stages) all run
        steps=3,
        warmup=1,
        timeline_steps=1,
        limit_steps=2,
        budget_s=100.0,
    ),
}


def local_stages(layout: str, rank: int, world: int, v: int) -> list[int]:
    if layout == "one":
        return [rank]
    if layout == "loop":
        return [rank + c * world for c in range(v)]
    return [rank, 2 * world - 1 - rank]  # V: rank r holds r and 2p−1−r


# ---------------------------------------------------------------------------------------------
# process setup, collectives that every rank calls in the same order
# ---------------------------------------------------------------------------------------------


class Processes:
    """This process in the benchmark's group (torchrun's environment): NCCL on its GPU
    (``LOCAL_RANK``) or gloo on one CPU thread, and the collectives every rank calls in the
    same order. ``env``: variables set, unless already set, before NCCL and the allocator
    start."""

    def __init__(self, cuda: bool, pg_timeout: float, env: Mapping[str, str] | None = None) -> None:
        self.cuda = cuda
        local = int(os.environ.get("LOCAL_RANK", "0"))
        timeout = timedelta(seconds=pg_timeout)
        if cuda:
            for key, value in (env or {}).items():
                os.environ.setdefault(key, value)
            torch.cuda.set_device(local)
            self.device = torch.device("cuda", local)
            dist.init_process_group("nccl", timeout=timeout, device_id=self.device)
        else:
            torch.set_num_threads(1)
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.t0 = time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        dist.barrier()

    def gather(self, obj) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


class Ctx(Processes):
    """``gpu_pipeline.py``'s process: its arguments, dtype, GPT config and seeded stage copies."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(torch.cuda.is_available() and args.device != "cpu", args.pg_timeout)
        self.args = args
        self.dtype = getattr(torch, args.dtype)
        self.cfg = GPTConfig(
            vocab_size=args.vocab,
            seq_len=args.seq,
            num_layers=args.layers,
            hidden=args.hidden,
            num_heads=args.heads,
        )
        self._masters: dict[tuple[int, int], torch.nn.Module] = {}

    def agree(self, obj):
        """Rank 0's value on every rank (decisions that all ranks must take together)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def stage(self, num_stages: int, s: int) -> torch.nn.Module:
        """A fresh copy of stage ``s`` of ``num_stages`` on this device (one seeded master each)."""
        key = (num_stages, s)
        if key not in self._masters:
            self._masters[key] = make_stage(self.cfg, s, num_stages, seed=0).to(self.dtype)
        return copy.deepcopy(self._masters[key]).to(self.device)

    def batch(self, n: int):
        g = torch.Generator().manual_seed(1234 + n)
        shape = (n * self.args.mb_size, self.cfg.seq_len)
        x = torch.randint(0, self.cfg.vocab_size, shape, generator=g)
        y = torch.randint(0, self.cfg.vocab_size, shape, generator=g)
        return x.to(self.device), y.to(self.device)

    def mem_reset(self) -> int:
        gc.collect()
        if not self.cuda:
            return 0
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def mem_peak(self) -> int | None:
        return torch.cuda.max_memory_allocated(self.device) if self.cuda else None

    def mem_now(self) -> int | None:
        return torch.cuda.memory_allocated(self.device) if self.cuda else None


def log(ctx: Ctx, msg: str) -> None:
    if ctx.rank == 0:
        print(f"[{ctx.elapsed():7.1f}s] {msg}", flush=True)


def make_pipeline(ctx: Ctx, name: str, n: int, timeout_s: float, **options):
    """pipetrain's ``Pipeline`` of schedule ``name`` over ``n`` micro-batches, each rank building
    its own stages (``ctx.stage``); ``options`` go to ``Pipeline`` (``overlap_pairs=`` …)."""
    from pipetrain.runtime.pipeline import Pipeline

    fam = FAMILIES[name]
    num_stages = fam.stages_per_rank * ctx.world
    return Pipeline(
        lambda s: ctx.stage(num_stages, s),
        name,
        n,
        lm_loss,
        stages_per_rank=fam.stages_per_rank,
        num_stages=num_stages,
        device=ctx.device,
        timeout=timedelta(seconds=timeout_s),
        **options,
    )


def make_optimizer(ctx: Ctx, params):
    params = [p for p in params if p.requires_grad]
    if ctx.args.optimizer == "none":
        return None
    if ctx.args.optimizer == "sgd":
        return torch.optim.SGD(params, lr=1e-4, foreach=True)
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def opt_step(opt, params) -> None:
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=False)
    else:
        for p in params:
            p.grad = None


class GcPauses:
    """The garbage collector's pauses on this rank, per timed step (``gc.callbacks``).

    A pipeline waits for its slowest rank at every transfer, so one rank's full collection (tens
    of ms with a large heap: torch, Megatron and DeepSpeed imported) stretches the whole step, and
    ranks collecting at different steps add their pauses up. ``--gc manual`` is Megatron-LM's
    ``--manual-gc`` (and torchtitan's ``gc_freq``): the collector off across the timed steps, one
    collection before them, for every library alike."""

    def __init__(self) -> None:
        self.per_step: list[float] = []
        self._began = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        elif self.per_step:
            self.per_step[-1] += time.perf_counter() - self._began


def time_steps(ctx: Ctx, fn, count: int, pauses: GcPauses | None = None) -> list[float]:
    """Per-step wall times (s) on this rank: barrier, synchronize, step, synchronize. The
    collector's pauses during each step go into ``pauses``; with ``--gc manual`` it is off."""
    times = []
    manual = getattr(ctx.args, "gc", "python") == "manual"
    pauses = pauses if pauses is not None else GcPauses()
    gc.collect()
    if manual:
        gc.disable()
    gc.callbacks.append(pauses)
    try:
        for _ in range(count):
            ctx.barrier()
            ctx.sync()
            pauses.per_step.append(0.0)
            t = time.perf_counter()
            fn()
            ctx.sync()
            times.append(time.perf_counter() - t)
    finally:
        gc.callbacks.remove(pauses)
        if manual:
            gc.enable()
    return times


def clock_stamp() -> str:
    """Local time as ``nvidia-smi`` writes its ``timestamp`` field (``incumbents_clocks``)."""
    now = time.time()
    return time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e3):03d}"


def slowest(ctx: Ctx, times: list[float]) -> list[float]:
    """Per step, the slowest rank's time (collective)."""
    everyone = ctx.gather(times)
    return [max(ts) for ts in zip(*everyone)]


def stats(times: list[float]) -> dict:
    return {
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "max_ms": 1e3 * max(times),
        "all_ms": [round(1e3 * t, 3) for t in times],
    }


# ---------------------------------------------------------------------------------------------
# model arithmetic
# ---------------------------------------------------------------------------------------------


def flops_per_token(cfg: GPTConfig) -> float:
    h, L = cfg.hidden, cfg.num_layers
    block = 4 * h * h + 4 * h + 2 * cfg.mlp_ratio * h * h + (cfg.mlp_ratio + 1) * h + 4 * h
    params = L * block + 2 * h + h * cfg.vocab_size  # blocks + final LN + head (no embeddings)
    return 6 * params + 12 * L * cfg.seq_len * h


def allocator_counts(device: torch.device) -> tuple[int, int]:
    """The caching allocator's retries (its cache freed and the device synchronised to find
    memory) and ``cudaMalloc`` calls so far on ``device``; zeros off CUDA."""
    if device.type != "cuda":
        return (0, 0)
    stats = torch.cuda.memory_stats(device)
    return stats.get("num_alloc_retries", 0), stats.get("num_device_alloc", 0)
