"""time(I) + time(W) against time(B) for one transformer block (docs/benchmarks.md); a benchmark.

    python benchmarks/runtime/split_backward_gpu.py [--out DIR]            # one GPU (CPU works, slowly)

One ``Block`` from ``pipetrain.app.models.gpt`` (bf16, hidden 2048, sequence 1024, batch 4 by
default). Each repetition runs a fresh forward (the split's ``call``), then either ``B``
(``backward_full``) or ``I`` (``backward_input``) followed by ``W`` (``backward_weight``) — a
``BackwardSplit``'s methods, called as the runtime's ``StageRunner`` calls them. Two timings,
medians over many repetitions:

* **gpu**: CUDA events around each piece while the GPU is kept busy by a ``torch.cuda._sleep``
  issued first, so the host enqueues everything before the GPU reaches the events: pure device
  time, the number the target (I + W ≤ 1.1 × B) is about;
* **exposed**: the same after a ``synchronize``, so host work (the graph walk that plans the
  split, kernel launches) shows as GPU idle time — what a rank pays when its host is not ahead.

Host (CPU) time to issue each piece is reported too. Correctness: I + W gradients (weights and
input) against B's, relative error in bf16 on the big block and in float64 on a small one.

Both ways of splitting are measured on the same block: ``graph_replay.GraphReplay`` (rows
``gpu`` and ``exposed``; ``W`` through ``AccumulateGrad``) and ``deferred_wgrad.DeferredLinears``,
the deferred linear GEMMs (``Pipeline(defer_weight_grads=True)``; rows ``gpu-deferred`` and
``exposed-deferred``; ``I`` and ``W`` as for a micro-batch that is not the step's last weight
piece, ``W`` adding straight into ``.grad``). ``B`` is an ordinary backward in both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.autograd.graph import get_gradient_edge

from pipetrain.app.models.gpt import Block, GPTConfig
from pipetrain.runtime.backward.deferred_wgrad import DeferredLinears
from pipetrain.runtime.backward.graph_replay import GraphReplay
from pipetrain.runtime.backward.interface import BackwardSplit


@dataclass
class Split:
    """One way to split the block's backward, and whether its ``W`` goes through
    ``AccumulateGrad`` (``hooks``; otherwise straight into ``.grad``)."""

    split: BackwardSplit
    w_hooks: bool


def replay() -> Split:
    """``graph_replay``'s graph replay (``Pipeline(defer_weight_grads=False)``)."""
    return Split(GraphReplay(), w_hooks=True)


def deferred(block) -> Split:
    """The block's linears deferred (``Pipeline(defer_weight_grads=True)``'s split); the block
    itself is unchanged (the split reroutes its linears only inside ``call``)."""
    return Split(DeferredLinears(block), w_hooks=False)


def make(cfg: GPTConfig, device, dtype, batch: int, seed: int = 0):
    torch.manual_seed(seed)
    block = Block(cfg).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    shape = (batch, cfg.seq_len, cfg.hidden)
    x = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    g = torch.randn(shape, device=device, dtype=dtype, generator=gen)
    return block, x, g


def forward(block, split: Split, x):
    xi = x.detach().requires_grad_()
    out = split.split.call(block, (xi,))
    return xi, [get_gradient_edge(out)]


def run_b(block, split: Split, x, g, marks, params):
    xi, roots = forward(block, split, x)
    marks("start")
    found = split.split.backward_full(roots, [g], [xi], params, hooks=True)
    marks("b")
    return found


def run_iw(block, split: Split, x, g, marks, params):
    xi, roots = forward(block, split, x)
    marks("start")
    found, work = split.split.backward_input(roots, [g], [xi], params, last_piece=False)
    marks("i")
    split.split.backward_weight(work, hooks=split.w_hooks)
    marks("w")
    del work
    return found


class Marks:
    """CUDA events (or clocks) at named points, plus host time per piece."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.points: list[tuple[str, object, float]] = []

    def __call__(self, name: str) -> None:
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.points.append((name, ev, time.perf_counter()))

    def durations(self) -> dict[str, tuple[float, float]]:
        """name → (device ms since the previous mark, host ms since the previous mark)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (_, e0, h0), (name, e1, h1) in zip(self.points, self.points[1:]):
            dev = e0.elapsed_time(e1) if self.cuda else (h1 - h0) * 1e3
            out[name] = (dev, (h1 - h0) * 1e3)
        return out


def bench(block, split: Split, x, g, reps: int, warmup: int, cuda: bool, busy: bool) -> dict:
    params = [p for p in block.parameters() if p.requires_grad]
    res: dict[str, list[float]] = {k: [] for k in ("b", "i", "w", "host_b", "host_i", "host_w")}
    for r in range(warmup + reps):
        for which in ("b", "iw") if r % 2 == 0 else ("iw", "b"):
            block.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                if busy:
                    torch.cuda._sleep(100_000_000)  # ~50 ms: the host runs ahead of the GPU
            marks = Marks(cuda)
            if which == "b":
                run_b(block, split, x, g, marks, params)
            else:
                run_iw(block, split, x, g, marks, params)
            if r < warmup:
                marks.durations()
                continue
            for name, (dev, host) in marks.durations().items():
                res[name].append(dev)
                res["host_" + name].append(host)
    med = {k: statistics.median(v) for k, v in res.items()}
    return {
        "b_ms": med["b"],
        "i_ms": med["i"],
        "w_ms": med["w"],
        "ratio": (med["i"] + med["w"]) / med["b"],
        "host_b_ms": med["host_b"],
        "host_i_ms": med["host_i"],
        "host_w_ms": med["host_w"],
        "reps": reps,
    }


def grads_of(block, split: Split, x, g, whole: bool):
    """Every gradient (and the input's) from ``B`` (``whole``) or from ``I`` then ``W``."""
    block.zero_grad(set_to_none=True)
    params = [p for p in block.parameters() if p.requires_grad]
    if whole:
        found = run_b(block, split, x, g, lambda _: None, params)
    else:
        found = run_iw(block, split, x, g, lambda _: None, params)
    out = {n: p.grad.detach().clone() for n, p in block.named_parameters()}
    out["<input>"] = found[0].detach().clone()
    return out


def max_rel_error(a: dict, b: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for k in a:
        num = (a[k].double() - b[k].double()).norm().item()
        den = b[k].double().norm().item() or 1.0
        if num / den >= worst:
            worst, where = num / den, k
    return worst, where


def block_arguments(p: argparse.ArgumentParser, reps: int) -> None:
    """The block's shape and the repetitions (shared with ``host_profile_gpu.py``)."""
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--reps", type=int, default=reps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    block_arguments(p, reps=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    p.add_argument("--out", default=None, help="folder for split_backward.json")
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(2)
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    cfg = GPTConfig(hidden=a.hidden, num_heads=a.heads, seq_len=a.seq, num_layers=1)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"split_backward_gpu: {name}, torch {torch.__version__}, block {cfg}, batch {a.batch}")
    result: dict = {"device": name, "torch": torch.__version__, "dtype": str(dtype)}

    # correctness: float64 small block, then the big block in its own dtype
    small = GPTConfig(hidden=64, num_heads=4, seq_len=16, num_layers=1)
    blk, x, g = make(small, device, torch.float64, 2)
    ref64 = grads_of(blk, replay(), x, g, whole=True)
    err64, where64 = max_rel_error(grads_of(blk, replay(), x, g, whole=False), ref64)
    err64d, where64d = max_rel_error(grads_of(blk, deferred(blk), x, g, whole=False), ref64)
    blk, x, g = make(cfg, device, dtype, a.batch)
    splits = {"": replay(), "-deferred": deferred(blk)}
    ref = grads_of(blk, splits[""], x, g, whole=True)
    err, where = max_rel_error(grads_of(blk, splits[""], x, g, whole=False), ref)
    errd, whered = max_rel_error(grads_of(blk, splits["-deferred"], x, g, whole=False), ref)
    result.update(rel_err_float64=err64, rel_err_float64_at=where64, rel_err=err, rel_err_at=where)
    result.update(
        deferred_rel_err_float64=err64d,
        deferred_rel_err_float64_at=where64d,
        deferred_rel_err=errd,
        deferred_rel_err_at=whered,
    )

    for mode, busy in (("gpu", True), ("exposed", False)):
        if mode == "gpu" and not cuda:
            continue
        for suffix, split in splits.items():
            result[mode + suffix] = bench(blk, split, x, g, a.reps, a.warmup, cuda, busy)

    lines = [
        "",
        f"## split backward, one block ({name}, {str(dtype).removeprefix('torch.')}, "
        f"h={a.hidden}, s={a.seq}, b={a.batch}; medians of {a.reps})",
        "| timing | B ms | I ms | W ms | (I+W)/B | host B ms | host I ms | host W ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in ("gpu", "gpu-deferred", "exposed", "exposed-deferred"):
        r = result.get(mode)
        if r:
            lines.append(
                f"| {mode} | {r['b_ms']:.3f} | {r['i_ms']:.3f} | {r['w_ms']:.3f} | "
                f"**{r['ratio']:.3f}** | {r['host_b_ms']:.3f} | {r['host_i_ms']:.3f} | "
                f"{r['host_w_ms']:.3f} |"
            )
    ok64 = max(err64, err64d) <= 1e-12
    for label, e64, w64, e, w in (
        ("graph replay", err64, where64, err, where),
        ("deferred", err64d, where64d, errd, whered),
    ):
        lines.append(
            f"I+W vs B gradients ({label}): float64 small block max rel err {e64:.2e} ({w64}) "
            f"{'OK' if e64 <= 1e-12 else 'FAIL'}; {str(dtype).removeprefix('torch.')} big block "
            f"{e:.2e} ({w})"
        )
    head = result.get("gpu") or result.get("exposed")
    lines.append(
        f"target (I+W) <= 1.1 × B on device time: {head['ratio']:.3f} "
        f"{'MET' if head['ratio'] <= 1.1 else 'MISSED'}"
    )
    print("\n".join(lines), flush=True)
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "split_backward.json").write_text(json.dumps(result, indent=1))
    return 0 if ok64 else 1


if __name__ == "__main__":
    sys.exit(main())
