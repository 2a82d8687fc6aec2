"""Activation offload on GPU: peak memory and step time of no offload, layer-by-layer offload at
several fractions, full and selective recompute, on one pipeline shape.

Llama-8B-shaped layers (hidden 4096, 32 query heads and 8 key/value heads, SwiGLU 14336),
sequence 8192, micro-batches of one sequence, bf16, 2 pipeline stages (one per GPU) of 4 layers
each, 8 micro-batches, 1F1B, no optimizer; written in plain torch so the script needs nothing but
torch and pipetrain. Each stage is a ``pipetrain`` ``Stage`` of its layers (what
``pipetrain.split`` makes), so offload moves layer by layer (``runtime.host_offload``: each
offloaded layer's saved tensors leave as its forward ends, and come back one layer ahead of its
backward). Variants, each a fresh ``Pipeline`` on the same weights and batch:

* ``none``: nothing offloaded, nothing recomputed;
* ``offload F``: ``Pipeline(offload=OffloadSpec(...))`` with fraction F (the first ⌈F·4⌉ layers)
  on every stage that has a micro-batch to offload (``schedule.offload.offloadable_stages``;
  1F1B's last stage has none), reloads ``--reload-lead`` compute actions ahead;
* ``recompute full`` and ``recompute selective``: every layer checkpointed
  (``runtime.backward.activation_checkpoint.recompute_stage``, what a plan's recompute does).

Per variant, per rank: the peak allocated GiB over the timed steps and what stays allocated after
a step (parameters and gradients), the median step ms over ``--steps`` timed steps (each between
two synchronisations), the GiB offloaded per step and the GiB the offloaded micro-batches saved
(their ratio is the share of activation bytes offloaded), and the first step's loss and squared
gradient sum (offload moves tensors, not values: they must match ``none``). Also the measured
host bandwidth each way. One line per variant as it goes; the JSON (``$OUT/offload_gpu.json``, or
``--out``) is rewritten after every variant, so a run stopped by its time limit keeps what it
measured. ``--budget-s`` skips the variants that would start after that many seconds.

On 2 GPUs, from the repository root::

    PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/offload/offload_gpu.py

A CPU dry run (gloo, a tiny shape, float32, every code path; spawns its 2 processes itself)::

    python benchmarks/offload/offload_gpu.py --device cpu

(PipeOffload, Wan et al. 2025, arXiv 2503.01328, reports at least half of the activations
offloadable at negligible cost; issue 20's targets: offload >= 75% of activation bytes within 2%
of the step time without offload, and at the offloaded run's peak, >= 1.25x faster than full
recompute.)
"""

from __future__ import annotations

import argparse
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
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from torch import nn

import pipetrain
from benchmarks.common.local_launch import launch
from pipetrain.runtime.backward.activation_checkpoint import recompute_stage
from pipetrain.runtime.named_layers import Stage
from pipetrain.schedule.offload import OffloadSpec, offloadable_stages
from pipetrain.schedule.registry import build_schedule

GIB = 2**30
#: the CPU dry run's shape: every code path, seconds per variant
CPU_SHAPE = {"hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "seq": 32}


class Layer(nn.Module):
    """One Llama decoder layer: RMSNorm, grouped-query attention, RMSNorm, SwiGLU."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, s, self.heads, self.dim).transpose(1, 2)
        k, v = self.kv(y).view(b, s, 2, self.kv_heads, self.dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def build_stage(args: argparse.Namespace, index: int, recompute: str) -> nn.Module:
    """Stage ``index``'s layers, made on the device (the same weights in every variant)."""
    torch.manual_seed(index)
    with torch.device(args.device):
        layers = [
            Layer(args.hidden, args.heads, args.kv_heads, args.ffn)
            for _ in range(args.layers_per_stage)
        ]
    first = index * args.layers_per_stage
    stage = Stage([(f"layers.{first + i}", layer) for i, layer in enumerate(layers)])
    stage = stage.to(dtype=args.torch_dtype)
    return recompute_stage(stage, recompute, index)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


def _sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def run_variant(args: argparse.Namespace, label: str, fraction: float, recompute: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = args.device == "cuda"
    left_over = torch.cuda.memory_allocated() / GIB if cuda else 0.0  # ~0: earlier variants gone
    num_stages = world * args.stages_per_rank
    program = build_schedule(args.schedule, world, args.microbatches, args.stages_per_rank)
    able = offloadable_stages(program, args.reload_lead)
    offload = None
    if fraction:
        fractions = tuple(fraction if s in able else 0.0 for s in range(num_stages))
        offload = OffloadSpec(fractions, (args.reload_lead,) * num_stages)
    mine = program.placement.stages_of_rank(rank)
    stages = {s: build_stage(args, s, recompute) for s in mine}
    pipe = pipetrain.Pipeline(
        lambda s: stages[s], args.schedule, args.microbatches, loss_fn,
        stages_per_rank=args.stages_per_rank, num_stages=num_stages, offload=offload,
        device=None if cuda else "cpu", timeout=timedelta(seconds=args.timeout_s),
    )  # fmt: skip
    for runner in pipe._runners.values():
        if runner.offload is not None:
            runner.offload.min_bytes = args.min_bytes
    rows = args.microbatches * args.microbatch_size
    torch.manual_seed(1234)  # the same batch for every variant: their first steps must agree
    shape = (rows, args.seq, args.hidden)
    x = torch.randn(shape, device=args.device, dtype=args.torch_dtype)
    y = torch.randn_like(x)
    first_loss = float(pipe.step(x, y))
    # the first step's gradients, as a checksum per rank: offload moves tensors, not values
    grad_sum = sum(float(p.grad.float().square().sum()) for p in pipe.parameters())
    for _ in range(args.warmup - 1):
        pipe.step(x, y)
    _sync(args)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    moved_before, saved_before = _counters(pipe)
    times = []
    for _ in range(args.steps):
        _sync(args)
        start = time.perf_counter()
        pipe.step(x, y)
        _sync(args)
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated() / GIB if cuda else None
    resident = torch.cuda.memory_allocated() / GIB if cuda else None
    moved, saved = (
        now - before for now, before in zip(_counters(pipe), (moved_before, saved_before))
    )
    pipe.close()
    mine_row = (statistics.median(times), peak, resident, moved / args.steps / GIB,
                saved / args.steps / GIB, grad_sum, left_over)  # fmt: skip
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine_row)
    return {
        "variant": label,
        "offload": None if offload is None else list(offload.fractions),
        "reload_lead": args.reload_lead if offload is not None else None,
        "recompute": recompute,
        "step_ms": max(g[0] for g in gathered),
        "step_ms_per_rank": [g[0] for g in gathered],
        "peak_gib": [g[1] for g in gathered],
        "resident_gib": [g[2] for g in gathered],
        "offloaded_gib_per_step": [g[3] for g in gathered],
        "saved_by_offloaded_gib_per_step": [g[4] for g in gathered],
        "first_loss": first_loss,
        "first_grad_sq_sum": [g[5] for g in gathered],
        "left_over_gib": [g[6] for g in gathered],
    }


def _counters(pipe: pipetrain.Pipeline) -> tuple[int, int]:
    offloads = [r.offload for r in pipe._runners.values() if r.offload is not None]
    return sum(o.moved_bytes for o in offloads), sum(o.saved_bytes for o in offloads)


def host_bandwidth(args: argparse.Namespace) -> dict[str, float] | None:
    """GB/s of one pinned copy each way (``--bandwidth-mib`` MiB, best of 3), or None on CPU."""
    if args.device != "cuda":
        return None
    n = args.bandwidth_mib * 2**20
    device = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out = {}
    for name, dst, src in (("to_host_gbs", host, device), ("to_device_gbs", device, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        out[name] = n / best / 1e9
    del device, host
    return out


def variants(args: argparse.Namespace) -> list[tuple[str, float, str]]:
    out = [("none", 0.0, "none")]
    out += [(f"offload {f}", float(f), "none") for f in args.fractions.split(",") if f]
    out += [(f"recompute {m}", 0.0, m) for m in args.recompute.split(",") if m]
    return out


def check_consistency(results: list[dict], exact: bool) -> list[str]:
    """Offload variants whose first step differs from ``none``'s (bitwise where ``exact``,
    else beyond bf16 noise): offload moves tensors and must not change values."""
    base = next((r for r in results if r["variant"] == "none"), None)
    problems = []
    for r in results:
        if base is None or not r["variant"].startswith("offload"):
            continue
        pairs = [(r["first_loss"], base["first_loss"])]
        pairs += list(zip(r["first_grad_sq_sum"], base["first_grad_sq_sum"]))
        for got, want in pairs:
            off = abs(got - want) / max(abs(want), 1e-30)
            if (exact and got != want) or off > 1e-2:
                problems.append(f"{r['variant']}: {got} != none's {want}")
    return problems


def main(argv: list[str] | None = None) -> None:
    launch(parse(argv), _run)


def _run(args: argparse.Namespace, rank: int, world: int) -> None:
    began = time.perf_counter()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    else:
        torch.set_num_threads(1)  # processes x threads would oversubscribe the cores
    backend = "nccl" if cuda else "gloo"
    timeout = timedelta(seconds=args.timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout)
    say = (lambda text: print(f"[offload_gpu {time.perf_counter() - began:6.1f}s] {text}",
                              flush=True)) if rank == 0 else (lambda text: None)  # fmt: skip
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "world": world,
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items() if k != "torch_dtype"},
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "host_bandwidth": host_bandwidth(args),
    }
    say(f"{meta['device']} x {world}, host bandwidth {meta['host_bandwidth']}")
    out = Path(args.out) / "offload_gpu.json"
    results: list[dict] = []
    for label, fraction, recompute in variants(args):
        go = [time.perf_counter() - began < args.budget_s]
        dist.broadcast_object_list(go, src=0)  # every rank skips together
        if not go[0]:
            say(f"{label}: skipped (past --budget-s {args.budget_s})")
            results.append({"variant": label, "skipped": True})
            continue
        say(f"{label}: running")
        row = run_variant(args, label, fraction, recompute)
        gc.collect()  # a pipeline in a reference cycle would hold its stages into the next variant
        if cuda:
            torch.cuda.empty_cache()  # the variant's stages are gone: start the next one clean
        results.append(row)
        say(_line(row))
        if rank == 0:
            problems = check_consistency(results, exact=not cuda)
            _write(out, meta, results, problems)
    problems = check_consistency(results, exact=not cuda)
    for problem in problems:
        say(f"MISMATCH {problem}")
    if rank == 0:
        _write(out, meta, results, problems)
        say(f"wrote {out}")
    dist.destroy_process_group()
    if problems and args.device == "cpu":
        raise SystemExit(1)


def _line(row: dict) -> str:
    def gib(values: list) -> str:
        return "[" + ", ".join("-" if v is None else f"{v:.3g}" for v in values) + "]"

    share = [m / s if s else 0.0 for m, s in
             zip(row["offloaded_gib_per_step"], row["saved_by_offloaded_gib_per_step"])]  # fmt: skip
    return (
        f"{row['variant']}: step {row['step_ms']:.1f} ms (median), peak GiB "
        f"{gib(row['peak_gib'])}, resident {gib(row['resident_gib'])}, offloaded GiB/step "
        f"{gib(row['offloaded_gib_per_step'])} ({gib(share)} of what those micro-batches saved), "
        f"left over {gib(row['left_over_gib'])}"
    )


def _write(out: Path, meta: dict, results: list[dict], problems: list[str]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"meta": meta, "results": results, "mismatches": problems}, indent=1)
    out.write_text(text)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), default="cuda",
        help="cuda: NCCL, one GPU per process; cpu: a dry run on gloo (tiny shape, float32)")  # fmt: skip
    add("--schedule", default="1f1b", help="schedule family (default 1f1b)")
    add("--stages-per-rank", type=int, default=1, help="stages per rank (default 1; zbv: 2)")
    add("--layers-per-stage", type=int, default=4, help="decoder layers per stage (default 4)")
    add("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    add("--microbatch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    add("--seq", type=int, default=None, help="sequence length (default 8192; cpu: 32)")
    add("--hidden", type=int, default=None, help="hidden size (default 4096; cpu: 64)")
    add("--heads", type=int, default=None, help="query heads (default 32; cpu: 4)")
    add("--kv-heads", type=int, default=None, help="key/value heads (default 8; cpu: 2)")
    add("--ffn", type=int, default=None, help="SwiGLU width (default 14336; cpu: 128)")
    add("--dtype", choices=("bfloat16", "float32"), default=None,
        help="parameters and activations (default bfloat16; cpu: float32)")  # fmt: skip
    add("--fractions", default="0.5,0.75,1.0", help="offload fractions to measure")
    add("--reload-lead", type=int, default=1,
        help="compute actions between a reload and its backward (default 1)")  # fmt: skip
    add("--recompute", default="full,selective", help="recompute modes to measure")
    add("--min-bytes", type=int, default=None,
        help="saved tensors smaller than this stay on the device (default 1 MiB; cpu: 0)")  # fmt: skip
    add("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    add("--steps", type=int, default=None, help="timed steps (default 8; cpu: 2)")
    add("--budget-s", type=float, default=240.0,
        help="start no variant after this many seconds (default 240)")  # fmt: skip
    add("--timeout-s", type=float, default=120.0,
        help="how long any wait on a peer may take (default 120)")  # fmt: skip
    add("--bandwidth-mib", type=int, default=1024, help="bytes the bandwidth copy moves (MiB)")
    add("--nproc", type=int, default=2, help="processes to spawn without torchrun (default 2)")
    add("--out", default=os.environ.get("OUT", "out"), help="folder for offload_gpu.json ($OUT)")
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    gpu_shape = {"hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 14336, "seq": 8192}
    for name, value in (CPU_SHAPE if cpu else gpu_shape).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.torch_dtype = getattr(torch, args.dtype)
    args.min_bytes = args.min_bytes if args.min_bytes is not None else (0 if cpu else 2**20)
    args.steps = args.steps or (2 if cpu else 8)
    return args


if __name__ == "__main__":
    main()
