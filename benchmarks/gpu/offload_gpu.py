"""Activation offload on GPU: step time and peak memory of no offload, offload and full recompute.

Llama-8B-shaped layers (hidden 4096, 32 query heads and 8 key/value heads, SwiGLU 14336),
sequence 8192, bf16, 2 pipeline stages (one per GPU), written in plain torch so the script needs
nothing but torch and pipetrain. Each variant builds a fresh ``Pipeline`` on the same layers:

* ``none``: nothing offloaded, nothing recomputed;
* ``offload F``: ``Pipeline(offload=...)`` with fraction F on every stage that has a micro-batch
  to offload (``schedule.offload.offloadable_stages``; 1F1B's last stage has none);
* ``recompute``: every layer under a non-reentrant ``torch.utils.checkpoint``.

It prints one line per variant as it goes and writes ``$OUT/offload_gpu.json`` (or ``--out``):
per variant the mean step ms over the timed steps, each rank's peak allocated GiB and the bytes
offloaded per step. Run on 2 GPUs::

    torchrun --nproc-per-node 2 benchmarks/gpu/offload_gpu.py --layers-per-stage 2

(PipeOffload, arXiv 2503.01328, reports at least half of the activations offloadable at
negligible cost; the issue's targets: offload >= 75% of activation bytes within 2% of the step
time without offload, and at the offloaded run's peak, >= 1.25x faster than full recompute.)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import pipetrain
from pipetrain.schedule.offload import offloadable_stages
from pipetrain.schedule.registry import build_schedule

GIB = 2**30


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


class Checkpointed(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.layer, x, use_reentrant=False)


def build_stage(args: argparse.Namespace, index: int, recompute: bool) -> nn.Module:
    torch.manual_seed(index)
    layers = [
        Layer(args.hidden, args.heads, args.kv_heads, args.ffn)
        for _ in range(args.layers_per_stage)
    ]
    wrapped = [Checkpointed(layer) if recompute else layer for layer in layers]
    return nn.Sequential(*wrapped).to(device="cuda", dtype=torch.bfloat16)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


def run_variant(args: argparse.Namespace, label: str, fraction: float, recompute: bool) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    left_over = torch.cuda.memory_allocated() / GIB  # should be ~0: what earlier variants left
    num_stages = world * args.stages_per_rank
    program = build_schedule(args.schedule, world, args.microbatches, args.stages_per_rank)
    able = offloadable_stages(program)
    offload = [fraction if s in able else 0.0 for s in range(num_stages)] if fraction else None
    mine = program.placement.stages_of_rank(rank)
    stages = {s: build_stage(args, s, recompute) for s in mine}
    pipe = pipetrain.Pipeline(
        lambda s: stages[s], args.schedule, args.microbatches, loss_fn,
        stages_per_rank=args.stages_per_rank, num_stages=num_stages, offload=offload,
    )  # fmt: skip
    rows = args.microbatches * args.microbatch_size
    torch.manual_seed(1234)  # the same batch for every variant: their first steps must agree
    x = torch.randn(rows, args.seq, args.hidden, device="cuda", dtype=torch.bfloat16)
    y = torch.randn_like(x)
    first_loss = pipe.step(x, y)
    # the first step's gradients, as a checksum per rank: offload moves tensors, not values
    grad_sum = sum(float(p.grad.float().square().sum()) for p in pipe.parameters())
    for _ in range(args.warmup - 1):
        pipe.step(x, y)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    moved_before = _moved(pipe)
    start = time.perf_counter()
    for _ in range(args.steps):
        pipe.step(x, y)
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - start) / args.steps * 1e3
    peak = torch.cuda.max_memory_allocated() / GIB
    moved = (_moved(pipe) - moved_before) / args.steps
    pipe.close()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (step_ms, peak, moved, grad_sum, left_over))
    return {
        "variant": label,
        "offload": offload,
        "recompute": recompute,
        "step_ms": max(g[0] for g in gathered),
        "peak_gib": [g[1] for g in gathered],
        "offloaded_gib_per_step": [g[2] / GIB for g in gathered],
        "first_loss": None if first_loss is None else float(first_loss),
        "first_grad_sq_sum": [g[3] for g in gathered],
        "left_over_gib": [g[4] for g in gathered],
    }


def _moved(pipe: pipetrain.Pipeline) -> int:
    return sum(r.offload.moved_bytes for r in pipe._runners.values() if r.offload is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--schedule", default="1f1b", help="schedule family (default 1f1b)")
    add("--stages-per-rank", type=int, default=1, help="stages per rank (default 1; zbv: 2)")
    add("--layers-per-stage", type=int, default=2, help="decoder layers per stage (default 2)")
    add("--microbatches", type=int, default=8, help="micro-batches per step (default 8)")
    add("--microbatch-size", type=int, default=1, help="sequences per micro-batch (default 1)")
    add("--seq", type=int, default=8192, help="sequence length (default 8192)")
    add("--hidden", type=int, default=4096)
    add("--heads", type=int, default=32)
    add("--kv-heads", type=int, default=8)
    add("--ffn", type=int, default=14336)
    add("--fractions", default="0.5,0.75,1.0", help="offload fractions to measure")
    add("--warmup", type=int, default=2)
    add("--steps", type=int, default=5)
    add("--out", default=os.environ.get("OUT", "."), help="folder for offload_gpu.json ($OUT)")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    rank = dist.get_rank()
    variants = [("none", 0.0, False)]
    variants += [(f"offload {f}", float(f), False) for f in args.fractions.split(",")]
    variants.append(("recompute", 0.0, True))
    results = []
    for label, fraction, recompute in variants:
        if rank == 0:
            print(f"[offload_gpu] {label}: running", flush=True)
        row = run_variant(args, label, fraction, recompute)
        gc.collect()  # a pipeline in a reference cycle would hold its stages into the next variant
        torch.cuda.empty_cache()  # the variant's stages are gone: start the next one clean
        results.append(row)
        if rank == 0:
            peaks = ", ".join(f"{p:.2f}" for p in row["peak_gib"])
            moved = ", ".join(f"{m:.2f}" for m in row["offloaded_gib_per_step"])
            print(
                f"[offload_gpu] {label}: step {row['step_ms']:.1f} ms, peak GiB [{peaks}], "
                f"offloaded GiB/step [{moved}], left over before {row['left_over_gib']}",
                flush=True,
            )
    if rank == 0:
        out = Path(args.out) / "offload_gpu.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "args": vars(args),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
        out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        print(f"[offload_gpu] wrote {out}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
