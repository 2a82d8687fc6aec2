"""Host (CPU) cost of the split backward: median µs per micro-batch of ``B``, ``I`` and ``W``.

On CPU with a tiny transformer block (hidden 64, seq 16, batch 2) the arithmetic is negligible,
so wall time is essentially host overhead: Python graph walking, hook registration and autograd
engine calls. The runtime's pattern is simulated: a fresh forward per micro-batch, then ``I``,
then ``W`` (or ``B`` alone), and the graph dropped.

The split timed is ``graph_replay.GraphReplay`` (one per block count, as one per stage in the
runtime), called through its ``BackwardSplit`` methods as ``StageRunner`` calls it. ``--baseline
REV`` also times ``graph_replay.py`` as it was at git revision ``REV`` (loaded from ``git
show``): its ``GraphReplay`` where it has one, else (revisions before the ``BackwardSplit``
protocol) its module-level ``backward_full``/``backward_input``/``backward_weight``, so
before/after numbers come from one run::

    .venv/bin/python benchmarks/runtime/split_backward_host.py --baseline HEAD

Measured results (the cached graph plan against the per-micro-batch walk before it):
docs/performance.md, "Split backward's host cost on CPU".
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipetrain.app.models.gpt import Block, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
MODULE = "pipetrain/runtime/backward/graph_replay.py"


def load_module(rev: str | None):
    if rev is None:
        from pipetrain.runtime.backward import graph_replay as split_backward

        return split_backward
    src = subprocess.run(
        ["git", "show", f"{rev}:{MODULE}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / f"split_backward_{rev.replace('/', '_')}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod


class ModuleFunctions:
    """A revision before the ``BackwardSplit`` protocol: its module-level functions, called as
    this benchmark called them then (one plan cache per process, shared by every stage)."""

    def __init__(self, mod) -> None:
        self.mod = mod

    def call(self, module: nn.Module, args: tuple[torch.Tensor, ...]):
        return module(*args)

    def backward_full(self, roots, grads, inputs, params, hooks: bool):
        return self.mod.backward_full(roots, grads, inputs)

    def backward_input(self, roots, grads, inputs, params, last_piece: bool = False):
        return self.mod.backward_input(roots, grads, inputs, params)

    def backward_weight(self, work, hooks: bool = True) -> None:
        self.mod.backward_weight(work)


def new_split(mod):
    """A fresh split of ``mod``'s kind for one stage (its own plan cache)."""
    if hasattr(mod, "GraphReplay"):
        return mod.GraphReplay()
    return ModuleFunctions(mod)


def stage(blocks: int) -> nn.Module:
    torch.manual_seed(0)
    cfg = GPTConfig(hidden=64, num_heads=4, seq_len=16)
    return nn.Sequential(*(Block(cfg) for _ in range(blocks)))


def measure(split, net: nn.Module, steps: int, warmup: int) -> dict[str, float]:
    """Median µs of ``B`` (an ordinary backward: ``hooks``), ``I`` and ``W`` on ``net``."""
    params = [p for p in net.parameters() if p.requires_grad]
    times: dict[str, list[float]] = {"B": [], "I": [], "W": []}
    clock = time.perf_counter
    for step in range(warmup + steps):
        keep = step >= warmup
        x = torch.randn(2, 16, 64, requires_grad=True)
        out = split.call(net, (x,))
        g = torch.randn_like(out)
        t0 = clock()
        split.backward_full([get_gradient_edge(out)], [g], [x], params, hooks=True)
        t1 = clock()
        x = torch.randn(2, 16, 64, requires_grad=True)
        out = split.call(net, (x,))
        t2 = clock()
        _, work = split.backward_input([get_gradient_edge(out)], [g], [x], params)
        t3 = clock()
        split.backward_weight(work)
        t4 = clock()
        del work, out
        if keep:
            times["B"].append(t1 - t0)
            times["I"].append(t3 - t2)
            times["W"].append(t4 - t3)
        for p in params:
            p.grad = None
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", metavar="REV", help="also time split_backward.py at git REV")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    versions = [("current", load_module(None))]
    if args.baseline:
        versions.insert(0, (args.baseline, load_module(args.baseline)))
    print(f"torch {torch.__version__}, {args.threads} thread(s), median µs of {args.steps}")
    print(f"{'version':>10} {'blocks':>6} {'B':>8} {'I':>8} {'W':>8} {'I+W':>8}")
    for blocks in (1, 2):
        for name, mod in versions:
            r = measure(new_split(mod), stage(blocks), args.steps, args.warmup)
            print(
                f"{name:>10} {blocks:>6} {r['B']:8.0f} {r['I']:8.0f} {r['W']:8.0f} "
                f"{r['I'] + r['W']:8.0f}"
            )


if __name__ == "__main__":
    main()
