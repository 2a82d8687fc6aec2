"""Host (CPU) cost of recomputing a stage: median µs per micro-batch's forward and backward of
two GPT blocks, plain, with each block in pipetrain's checkpoint wrapper (``Recomputed``:
``torch.utils.checkpoint`` non-reentrant, full or selective), and recomputed as a whole stage —
the forward under ``no_grad``, then the forward again with autograd and the backward, as a
reentrant checkpoint (or a stage that recomputes in its ``I``/``B``) would run it.

On CPU with tiny blocks (hidden 32, sequence 16, batch 2) the arithmetic is negligible, so the
times are host overhead: what an eager pipeline stage's host pays per micro-batch for each way of
recomputing (docs/benchmarks.md, "Why eager misses")::

    .venv/bin/python benchmarks/recompute/checkpoint_host.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from pipetrain.app.models.gpt import GPTConfig, gpt_layer
from pipetrain.runtime.backward.activation_checkpoint import Recomputed

CONFIG = GPTConfig(vocab_size=64, seq_len=16, num_layers=2, hidden=32, num_heads=2)


def ways(blocks: list[nn.Module]) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Each way of running the stage's forward for a backward right after it."""
    plain = nn.Sequential(*blocks)
    full = nn.Sequential(*(Recomputed(b, "full") for b in blocks))
    selective = nn.Sequential(*(Recomputed(b, "selective") for b in blocks))

    def whole_stage(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # the forward of F: nothing saved
            plain(x)
        return plain(x)  # again at the backward, with autograd

    return {
        "plain": plain,
        "per-block checkpoint, full": full,
        "per-block checkpoint, selective": selective,
        "whole stage, no_grad forward then forward and backward": whole_stage,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iterations", type=int, default=300, help="micro-batches per round")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    torch.manual_seed(0)
    blocks = [gpt_layer(CONFIG, i) for i in (1, 2)]
    x = torch.randn(2, CONFIG.seq_len, CONFIG.hidden, requires_grad=True)
    grad = torch.randn_like(x)
    runs = ways(blocks)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):  # interleaved, so that a busy moment hits every way alike
        for name, run in runs.items():
            for _ in range(20):
                run(x).backward(grad)
            start = time.perf_counter()
            for _ in range(args.iterations):
                run(x).backward(grad)
            times[name].append((time.perf_counter() - start) / args.iterations * 1e6)
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        us = statistics.median(ts)
        print(f"{name:56s} {us:7.0f} µs  {us / base:5.2f} × plain")


if __name__ == "__main__":
    main()
