"""What a stage holds per micro-batch under each recompute mode, measured on one GPU, against
what the planner's model predicts from a costs file (docs/planning.md, "Recompute").

The planner prices a recomputing stage layer by layer (``planner.recompute.layers_under``): full
recompute keeps each layer's input, selective also the outputs of matrix products and fused
attention, ``"full:K"`` / ``"selective:K"`` only on the stage's first K layers, and the layer that
feeds the loss stays plain under selective recompute. This script builds the model a costs file
was profiled from (its ``meta.config``: the app's GPT, as ``plan_gpu.py`` builds it), cuts it as
``--cut`` says, and for each stage and mode runs ``--microbatches`` forwards (the last stage's
with the loss), keeping them as a pipeline's warm-up does, then their backwards:

* ``held_gib``: memory allocated after the forwards, less before, per micro-batch — what the
  model calls ``activation`` summed over the stage's layers;
* ``peak_gib``: the peak during the backwards above the held forwards (the recompute's
  workspace, the gradients).

Each measured value is printed beside the model's from the costs file (``predicted_gib``; for
a stage recomputed as a whole also its backward peak, ``predicted_peak_gib``), and
``selective (loss layer wrapped)`` shows what the runtime held before the loss's layer was left
plain. One GPU, no process group::

    python benchmarks/recompute/recompute_memory_gpu.py --out $OUT \\
        --costs docs/results/h200x2-2026-11-28-plan-cuda-graph-sustained3/costs.json --cut 12,6

``--device cpu`` runs every path on a tiny model (its memory columns are zero: CPU allocations
are not counted; ``--costs`` is not read), for tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch

from pipetrain.app.models.gpt import GPTConfig, gpt_layer, lm_loss
from pipetrain.planner.costs_file import load_costs
from pipetrain.planner.partition import bounds
from pipetrain.planner.recompute import beside_later_layers, layers_under, recomputed_layer
from pipetrain.planner.recompute_modes import Recompute, stage_recompute
from pipetrain.runtime.backward.activation_checkpoint import recompute_layers, recompute_stage
from pipetrain.runtime.layers import split

GIB = float(1 << 30)
#: the modes measured on every stage, K half its layers; on the last also the loss's layer wrapped
MODES = ("none", "full:{k}", "full", "selective:{k}", "selective", "whole")
WRAPPED = "selective (loss layer wrapped)"
TINY = dict(vocab_size=64, seq_len=16, num_layers=4, hidden=32, num_heads=2, bias=False)


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--costs", help="the costs file whose model and prices are used")
    p.add_argument("--cut", default="12,6", help="layers per stage (default 12,6)")
    p.add_argument("--microbatches", type=int, default=4, help="forwards held at once")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", required=True)
    return p.parse_args()


def predicted(costs, a: int, b: int, mode: str) -> float | None:
    """The model's held GiB per micro-batch of layers ``a:b`` under ``mode``."""
    if costs is None:
        return None
    layers = costs.layers[a:b]
    if mode == WRAPPED:
        return sum(recomputed_layer(x, Recompute.SELECTIVE).activation for x in layers)
    return sum(
        x.activation for x in layers_under(layers, stage_recompute(mode), a, len(costs.layers))
    )


def predicted_peak(costs, a: int, b: int, stage) -> float | None:
    """The model's backward peak of a stage recomputed as a whole, above its held inputs: the
    recomputed activation and a plain backward's temporaries (``beside_later_layers`` of
    ``whole_stage``'s layers) and, from the second micro-batch on, the stage's gradients (the
    model counts those in its static memory; here they are counted from the stage's
    parameters)."""
    if costs is None:
        return None
    layers = layers_under(costs.layers[a:b], stage_recompute("whole"), a, len(costs.layers))
    grads = sum(p.numel() * p.element_size() for p in stage.parameters() if p.requires_grad)
    return beside_later_layers(layers) + grads / GIB


def measure(stage, inputs, targets, last: bool, device) -> tuple[float, float]:
    """(held GiB per micro-batch after the forwards, peak GiB above them in the backwards). A
    stage recomputed as a whole (``stage.recompute_whole``) runs as the pipeline runs it: the
    forwards without autograd, holding their inputs (which the caller holds here), then per
    micro-batch the forward again and its backward."""
    cuda = device.type == "cuda"
    whole = getattr(stage, "recompute_whole", False)
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device) if cuda else 0

    def forward(x, y):
        return lm_loss(stage(x), y) if last else stage(x)

    if whole:
        with torch.no_grad():
            for x, y in zip(inputs, targets):
                forward(x, y)
        outs = list(zip(inputs, targets))  # the recompute's arguments, held by the caller
    else:
        outs = [forward(x, y) for x, y in zip(inputs, targets)]
    held = (torch.cuda.memory_allocated(device) - before) if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    top = before + held
    for out in outs:
        if whole:
            out = forward(*out)
        if last:
            out.backward()
        else:
            out.backward(torch.ones_like(out))
    peak = (torch.cuda.max_memory_allocated(device) - top) if cuda else 0
    del outs
    for p in stage.parameters():
        p.grad = None
    return held / len(inputs) / GIB, peak / GIB


def main() -> int:
    args = arguments()
    device = torch.device(args.device)
    costs = load_costs(args.costs) if args.costs and args.device == "cuda" else None
    if args.device == "cuda":
        config = costs.meta["config"] if costs else {}
        cfg = GPTConfig(**config)
        b, dtype = costs.meta.get("micro_batch_size", 2), torch.bfloat16
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        cfg, b, dtype = GPTConfig(**TINY), 2, torch.float32
    cut = [int(c) for c in args.cut.split(",")] if args.device == "cuda" else [3, 3]
    started = time.perf_counter()
    layers = [gpt_layer(cfg, i).to(device=device, dtype=dtype) for i in range(cfg.num_layers + 2)]
    if sum(cut) != len(layers):
        raise SystemExit(f"--cut {cut} covers {sum(cut)} layers; the model has {len(layers)}")
    print(
        f"[{time.perf_counter() - started:5.1f}s] built {len(layers)} layers on {device}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=gen).to(device)
              for _ in range(args.microbatches)]  # fmt: skip
    rows = []
    for s, (a, z) in enumerate(bounds(cut)):
        last = z == len(layers)
        if last:
            with torch.no_grad():  # the stage's inputs: what the stage before it sends
                h = split(layers[:a], [a])[0]
                inputs = [h(t).detach().requires_grad_() for t in tokens]
        else:
            inputs = tokens
        targets = [torch.roll(t, -1, dims=1) for t in tokens]
        for mode in [m.format(k=(z - a) // 2) for m in MODES] + ([WRAPPED] if last else []):
            (stage,) = split(layers[a:z], [z - a])
            if mode == WRAPPED:
                recompute_layers(stage, dict.fromkeys(stage.layer_names, "selective"), s)
            else:
                recompute_stage(stage, mode, s, last=last)
            held, peak = measure(stage, inputs, targets, last, device)
            row = {"stage": s, "layers": [a, z], "mode": mode, "held_gib": round(held, 4),
                   "peak_gib": round(peak, 4), "predicted_gib": predicted(costs, a, z, mode)}  # fmt: skip
            if mode == "whole":
                row["predicted_peak_gib"] = predicted_peak(costs, a, z, stage)
            rows.append(row)
            pred = "" if row["predicted_gib"] is None else f"  predicted {row['predicted_gib']:.4f}"
            if row.get("predicted_peak_gib") is not None:
                pred += f", peak {row['predicted_peak_gib']:.4f}"
            print(f"[{time.perf_counter() - started:5.1f}s] stage {s} {mode:32s} held "
                  f"{held:.4f} GiB/mb  backward peak +{peak:.4f}{pred}", flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "cut": cut, "microbatches": args.microbatches,
            "costs": args.costs}  # fmt: skip
    (out / "recompute_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
