"""How long the host takes to issue a layer's forward and backward, beside how long the whole
takes (one GPU): the numbers an eager step's host-and-device model needs (docs/planning.md,
"Proof on GPUs", the eager bullet).

An eager pipeline rank's host issues its actions one after another and its device runs them as
they come, so a step is as long as the longer of the two paths, action by action; a price per
action that is the layer's wall time alone (what an eager profile measures) counts host time
that the device hides, and a device-time price misses host time that the device waits for. This
script measures, for the embedding, one block and the head with the loss of the model a costs
file was profiled from, under no, full and selective recompute: ``host`` — the time the Python
call takes to return with ``--microbatches`` forwards (then their backwards) issued and nothing
waited for (the CUDA queue does not fill at this size), per micro-batch — and ``wall`` — until
the device is done too, per micro-batch::

    python3 benchmarks/host/host_time_gpu.py --out $OUT \\
        --costs docs/results/h200x2-2026-11-28-plan-partial-recompute/costs.json

``--device cpu`` runs every path on a tiny model (host and wall then coincide), for tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from pipetrain.app.models.gpt import GPTConfig, gpt_layer, lm_loss
from pipetrain.planner.costs_file import load_costs
from pipetrain.runtime.backward.activation_checkpoint import Recomputed

TINY = dict(vocab_size=64, seq_len=16, num_layers=4, hidden=32, num_heads=2, bias=False)
MODES = ("none", "full", "selective")


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--costs", help="the costs file whose model is built")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", required=True)
    return p.parse_args()


def timed(fn, cuda: bool) -> tuple[float, float]:
    """(ms until ``fn`` returns, ms until the device is done too)."""
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    host = time.perf_counter() - start
    if cuda:
        torch.cuda.synchronize()
    return 1e3 * host, 1e3 * (time.perf_counter() - start)


def measure(layer, inputs, targets, last: bool, repeats: int, cuda: bool) -> dict:
    """Per micro-batch medians of host and wall ms, forward and backward."""
    n = len(inputs)
    got: dict[str, list[float]] = {k: [] for k in ("host_f", "wall_f", "host_b", "wall_b")}
    for rep in range(repeats + 2):  # two untimed rounds first
        outs: list[torch.Tensor] = []

        def forward(outs: list[torch.Tensor] = outs) -> None:
            for x, y in zip(inputs, targets):
                out = layer(x)
                outs.append(lm_loss(out, y) if last else out.float().square().mean())

        def backward(outs: list[torch.Tensor] = outs) -> None:
            for out in outs:
                out.backward()

        hf, wf = timed(forward, cuda)
        hb, wb = timed(backward, cuda)
        layer.zero_grad(set_to_none=True)
        if rep >= 2:
            for key, value in (("host_f", hf), ("wall_f", wf), ("host_b", hb), ("wall_b", wb)):
                got[key].append(value / n)
    return {k: round(statistics.median(v), 4) for k, v in got.items()}


def main() -> int:
    args = arguments()
    cuda = args.device == "cuda"
    device = torch.device(args.device)
    if cuda:
        costs = load_costs(args.costs) if args.costs else None
        cfg = GPTConfig(**(costs.meta["config"] if costs else {}))
        b, dtype = (costs.meta.get("micro_batch_size", 2) if costs else 2), torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        cfg, b, dtype = GPTConfig(**TINY), 2, torch.float32
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen).to(device)
              for _ in range(args.microbatches)]  # fmt: skip
    targets = [torch.roll(t, -1, dims=1) for t in tokens]
    hidden = [torch.randn(b, cfg.seq_len, cfg.hidden, generator=gen).to(device, dtype)
              .requires_grad_() for _ in range(args.microbatches)]  # fmt: skip
    rows = []
    for index, name in ((0, "embed"), (cfg.num_layers // 2, "block"), (cfg.num_layers + 1, "head")):
        layer = gpt_layer(cfg, index).to(device=device, dtype=dtype)
        inputs = tokens if name == "embed" else hidden
        for mode in MODES:
            if name == "head" and mode == "selective":
                continue  # the layer that feeds the loss stays plain under selective recompute
            wrapped = layer if mode == "none" else Recomputed(layer, mode)
            row = {"layer": name, "mode": mode,
                   **measure(wrapped, inputs, targets, name == "head", args.repeats, cuda)}  # fmt: skip
            rows.append(row)
            print(" ".join(f"{k} {v}" for k, v in row.items()), flush=True)
        del layer
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__, "microbatches": args.microbatches, "costs": args.costs}  # fmt: skip
    (out / "host_time.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
