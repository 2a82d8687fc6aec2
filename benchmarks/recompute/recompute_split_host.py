"""Host (CPU) cost of a stage's forward and quiet ``B`` under each backward split, with and
without full activation checkpointing: median ms per micro-batch.

Four tiny GPT blocks (hidden 32, seq 16, batch 2) on CPU: the arithmetic is negligible, so the
time is host overhead — Python, autograd, checkpointing's pack/unpack hooks. What a host-bound
pipeline step pays per stage and micro-batch, for ``DeferredLinears`` (every ``nn.Linear`` through
a Python autograd function, run twice when the layer recomputes) against graph replay (plain
``nn.Linear``; a recomputing stage's backward runs whole)::

    .venv/bin/python benchmarks/recompute/recompute_split_host.py

Measured results: docs/benchmarks.md, "Activation checkpointing under the pipeline".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.autograd.graph import get_gradient_edge

from pipetrain import split
from pipetrain.app.models.gpt import GPTConfig, gpt_layer
from pipetrain.runtime.backward.activation_checkpoint import recompute_stage
from pipetrain.runtime.backward.interface import choose_split


def per_microbatch_ms(defer: bool, mode: str, repeats: int, cfg: GPTConfig) -> float:
    torch.manual_seed(0)
    (stage,) = split([gpt_layer(cfg, i) for i in range(1, cfg.num_layers + 1)], [cfg.num_layers])
    if mode != "none":
        recompute_stage(stage, mode, 1)
    backward = choose_split(stage, defer, 1)
    params = list(stage.parameters())

    def once() -> None:
        x = torch.randn(2, cfg.seq_len, cfg.hidden, requires_grad=True)
        out = backward.call(stage, (x,))
        edge = [get_gradient_edge(out)]
        backward.backward_full(edge, [torch.ones_like(out)], [x], params, False)

    for _ in range(5):
        once()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cfg = GPTConfig(vocab_size=64, seq_len=16, num_layers=4, hidden=32, num_heads=2)
    print("| split | recompute | ms per micro-batch (F + B) |")
    print("|---|---|---|")
    for defer, name in ((True, "deferred"), (False, "replay")):
        for mode in ("none", "full", "selective"):
            print(f"| {name} | {mode} | {per_microbatch_ms(defer, mode, args.repeats, cfg):.2f} |")


if __name__ == "__main__":
    main()
