"""One mixture-of-experts block's forward and backward on one GPU: ``transformers``' grouped GEMM
path (``grouped_mm``) against its loop over experts (``eager``) and against a dense SwiGLU MLP of
the same active parameters (``top_k × moe_intermediate`` wide). A benchmark, not a test.

    python benchmarks/moe/experts_gpu.py --out $OUT                        # one GPU, bf16
    python benchmarks/moe/experts_gpu.py --preset cpu --out /tmp/moe        # CPU smoke, seconds

Shapes (``--preset gpu``, 4,096 tokens each):

* ``qwen3-moe-64e-top8``: Qwen3-MoE's block (its router and fused experts), 64 experts, top-8,
  hidden 2048, moe_intermediate 768 — the shape the mixture-of-experts issue measured;
* ``mixtral-8e-top2``: Mixtral's block, 8 experts, top-2, hidden 4096, intermediate 14336.

The MoE variants include the router (one ``hidden × experts`` GEMM, its softmax and top-k);
the dense MLP has none. Each variant runs on the same weights and the same input (which
requires its gradient, as a layer's input does inside a model); every iteration is timed with
CUDA events around the forward and around forward + backward (``time.perf_counter`` on the
CPU), and the median over ``--iters`` iterations after ``--warmup`` is reported, with the
memory the variant takes above the resident weights at its peak.
``batched_mm`` is not run: it gathers every token's expert weights, a
``(tokens·top_k, 2·I, H)`` tensor, 192 GiB in bf16 at the first shape.

The check: grouped and loop outputs and every gradient (input, router, experts) compared in
the run's dtype, as the largest absolute difference and that over the loop's largest magnitude
(normwise). The routing is the same in both (one router, same input), so the two differ only by
rounding: the loop rounds each expert's product to bf16 and adds the top-k contributions with
``index_add_`` in bf16, the grouped path sums them in one reduction; gradients accumulate the
same products in other orders. Passing means within :data:`TOLERANCE` (bf16: 2^-5, eight units
in the last place of bf16's 2^-8 rounding at the largest value, room for top-8 sums rounded
term by term). The rule pipetrain uses (``pipetrain.hf.experts_kernel``) is written beside it.

Writes ``results.json`` and ``results.md`` (the table) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from pipetrain.hf.experts_kernel import describe, grouped_kernel_available

#: largest normwise difference of grouped against loop, per dtype (see the module docstring)
TOLERANCE = {"bfloat16": 2**-5, "float16": 2**-8, "float32": 2**-16}

SHAPES = {
    "qwen3-moe-64e-top8": dict(family="qwen3_moe", experts=64, top_k=8, hidden=2048, inter=768),
    "mixtral-8e-top2": dict(family="mixtral", experts=8, top_k=2, hidden=4096, inter=14336),
    "tiny-qwen3-moe": dict(family="qwen3_moe", experts=8, top_k=2, hidden=32, inter=16),
    "tiny-mixtral": dict(family="mixtral", experts=4, top_k=2, hidden=32, inter=24),
}
PRESETS = {
    "gpu": dict(
        device="cuda",
        dtype="bfloat16",
        tokens=4096,
        iters=30,
        warmup=5,
        shapes=("qwen3-moe-64e-top8", "mixtral-8e-top2"),
    ),
    "cpu": dict(
        device="cpu",
        dtype="float32",
        tokens=64,
        iters=3,
        warmup=1,
        shapes=("tiny-qwen3-moe", "tiny-mixtral"),
    ),
}
VARIANTS = ("grouped_mm", "eager", "dense")


def build(shape: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """The family's sparse MoE block and a dense SwiGLU MLP of its active width, seeded."""
    import transformers as tf
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen

    common = dict(
        hidden_size=shape["hidden"],
        num_experts_per_tok=shape["top_k"],
        hidden_act="silu",
        experts_implementation="grouped_mm",
    )
    if shape["family"] == "mixtral":
        config = tf.MixtralConfig(
            **common,
            intermediate_size=shape["inter"],
            num_local_experts=shape["experts"],
            router_jitter_noise=0.0,
        )
        block_class = modeling_mixtral.MixtralSparseMoeBlock
    else:
        config = tf.Qwen3MoeConfig(
            **common,
            moe_intermediate_size=shape["inter"],
            num_experts=shape["experts"],
            norm_topk_prob=True,
        )
        block_class = qwen.Qwen3MoeSparseMoeBlock
    torch.manual_seed(seed)
    with torch.device(device):
        block = block_class(config).to(dtype)
        dense = qwen.Qwen3MoeMLP(config, intermediate_size=shape["top_k"] * shape["inter"])
        dense = dense.to(dtype)
    with torch.no_grad():  # the experts are torch.empty, Qwen3's router zeros: all drawn
        for p in [*block.parameters(), *dense.parameters()]:
            p.normal_(0.0, 0.02)
    return config, block, dense


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Mark:
    """A point in time: a CUDA event on the GPU (the stream's time), the host clock elsewhere."""

    def __init__(self, cuda: bool) -> None:
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        self.host = 0.0

    def record(self) -> None:
        if self.event is not None:
            self.event.record()
        else:
            self.host = time.perf_counter()

    def ms_to(self, later: _Mark) -> float:
        if self.event is not None and later.event is not None:
            return self.event.elapsed_time(later.event)
        return (later.host - self.host) * 1e3


def time_variant(module, x, grad, iters: int, warmup: int, device: torch.device) -> dict:
    """Median forward and forward + backward times (ms); on CUDA the memory resident before
    (every weight, no gradient) and the peak above it (activations and gradients), GiB."""
    cuda = device.type == "cuda"
    clear_grads(module, x)
    if cuda:
        sync(device)
        resident = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    forward, total = [], []
    for i in range(warmup + iters):
        clear_grads(module, x)
        sync(device)
        marks = [_Mark(cuda) for _ in range(3)]
        marks[0].record()
        out = module(x)
        marks[1].record()
        out.backward(grad)
        marks[2].record()
        sync(device)
        if i >= warmup:
            forward.append(marks[0].ms_to(marks[1]))
            total.append(marks[0].ms_to(marks[2]))
    row = {
        "forward_ms": statistics.median(forward),
        "forward_backward_ms": statistics.median(total),
        "iters": iters,
    }
    if cuda:
        row["resident_gib"] = resident / 2**30
        row["peak_above_gib"] = (torch.cuda.max_memory_allocated(device) - resident) / 2**30
    clear_grads(module, x)
    return row


def clear_grads(module, x) -> None:
    for p in module.parameters():
        p.grad = None
    x.grad = None


def outputs_and_grads(block, x, grad) -> dict[str, torch.Tensor]:
    """The block's output and the gradients of its input and parameters, detached."""
    clear_grads(block, x)
    out = block(x)
    out.backward(grad)
    got = {"output": out.detach().clone(), "grad input": x.grad.detach().clone()}
    for name, p in block.named_parameters():
        got[f"grad {name}"] = p.grad.detach().clone()
    clear_grads(block, x)
    return got


def compare(config, block, x, grad, dtype_name: str) -> dict:
    """Grouped against loop: the largest absolute and normwise differences of each tensor."""
    config._experts_implementation = "grouped_mm"
    grouped = outputs_and_grads(block, x, grad)
    config._experts_implementation = "eager"
    loop = outputs_and_grads(block, x, grad)
    tensors = {}
    for name, ref in loop.items():
        diff = (grouped[name].float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item()
        tensors[name] = {"max_abs": diff, "max_rel": diff / scale if scale else diff}
    worst = max(t["max_rel"] for t in tensors.values())
    tolerance = TOLERANCE[dtype_name]
    return {"tolerance": tolerance, "worst_rel": worst, "ok": worst <= tolerance, **tensors}


def run_shape(name: str, p: dict, device: torch.device) -> dict:
    shape = SHAPES[name]
    dtype = getattr(torch, p["dtype"])
    config, block, dense = build(shape, device, dtype)
    torch.manual_seed(1)
    x = torch.randn(1, p["tokens"], shape["hidden"], device=device, dtype=dtype)
    x.requires_grad_(True)
    grad = torch.randn_like(x)
    check = compare(config, block, x, grad, p["dtype"])
    timings = {}
    for variant in VARIANTS:
        if variant == "dense":
            timings[variant] = time_variant(dense, x, grad, p["iters"], p["warmup"], device)
            continue
        config._experts_implementation = variant
        timings[variant] = time_variant(block, x, grad, p["iters"], p["warmup"], device)
    active = 3 * shape["top_k"] * shape["hidden"] * shape["inter"]
    return {"shape": shape, "active_expert_params": active, "timings": timings, "check": check}


def table(result: dict) -> str:
    """The markdown table of results.md."""
    lines = [
        f"{result['device_name']}, {result['dtype']}, {result['tokens']} tokens; median of "
        f"{result['iters']} iterations after {result['warmup']} warm-up; "
        f"torch {result['torch']}, transformers {result['transformers']}.",
        "",
        f"Rule (`--experts auto`): {result['rule']}",
        "",
        "| shape | variant | forward ms | fwd+bwd ms | x grouped (fwd+bwd) | peak over weights GiB |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, shape in result["shapes"].items():
        base = shape["timings"]["grouped_mm"]["forward_backward_ms"]
        for variant, t in shape["timings"].items():
            peak = f"{t['peak_above_gib']:.2f}" if "peak_above_gib" in t else "-"
            lines.append(
                f"| {name} | {variant} | {t['forward_ms']:.3f} | {t['forward_backward_ms']:.3f} "
                f"| {t['forward_backward_ms'] / base:.2f} | {peak} |"
            )
    lines += ["", "| shape | grouped vs loop: worst tensor | max abs | max rel | tolerance | ok |"]
    lines.append("|---|---|---:|---:|---:|---|")
    for name, shape in result["shapes"].items():
        check = shape["check"]
        tensors = {k: v for k, v in check.items() if isinstance(v, dict)}
        worst = max(tensors, key=lambda k: tensors[k]["max_rel"])
        t = tensors[worst]
        lines.append(
            f"| {name} | {worst} | {t['max_abs']:.3g} | {t['max_rel']:.3g} "
            f"| {check['tolerance']:.3g} | {'yes' if check['ok'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, help="timed iterations (default: the preset's)")
    ap.add_argument("--tokens", type=int, help="tokens per block call (default: the preset's)")
    args = ap.parse_args(argv)
    p = dict(PRESETS[args.preset])
    p["iters"] = args.iters or p["iters"]
    p["tokens"] = args.tokens or p["tokens"]
    device = torch.device(p["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--preset gpu needs a CUDA device; --preset cpu runs here")
    import transformers

    dtype = getattr(torch, p["dtype"])
    result = {
        "preset": args.preset,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": p["dtype"],
        "tokens": p["tokens"],
        "iters": p["iters"],
        "warmup": p["warmup"],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "grouped_kernel": grouped_kernel_available(device, dtype),
        "rule": describe("auto", device, dtype),
        "shapes": {name: run_shape(name, p, device) for name in p["shapes"]},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    text = table(result)
    (out / "results.md").write_text(text)
    print(text, flush=True)
    return 0 if all(s["check"]["ok"] for s in result["shapes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
