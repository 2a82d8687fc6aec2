"""A Hugging Face Llama's layers as one stage, on a left-padded batch: forward and backward time
with each micro-batch's attention mask and rotary table built once for the stage
(``pipetrain.hf.masks.BuiltOnce``, the default) against once per decoder layer (what every layer
did before). A benchmark, not a test.

    python benchmarks/runtime/hf_masks_gpu.py --out $OUT                          # one GPU
    python benchmarks/runtime/hf_masks_gpu.py --preset cpu-smoke --out /tmp/masks   # CPU, seconds

With a padding mask, ``transformers``' SDPA mask builder reads a value on the host to learn
whether any token is padding: the host waits for the device there, once per build. Per pass: a
new copy of the batch's mask (a pipeline's micro-batches are new tensors each step), the stage's
forward, a backward of the logits' mean; timed with the device synchronised around the pass.
Rounds alternate the variants; per variant the median pass of each round and the mask builds per
pass. Both variants compute the same values: the first pass's loss is recorded for each and
must agree. Writes ``hf_masks.json`` under ``--out`` and prints a line per round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

import pipetrain
from pipetrain.hf import causal_lm_layers
from pipetrain.hf import masks as hf_masks

PRESETS = {
    # a Llama-shaped stage: GQA, SwiGLU, RoPE; 8 layers of hidden 2048, sequence 2048, bf16
    "llama-2048": dict(
        hidden=2048,
        layers=8,
        heads=16,
        kv_heads=8,
        ffn=5632,
        vocab=32000,
        seq=2048,
        rows=2,
        dtype="bfloat16",
        steps=20,
        warmup=3,
        rounds=3,
    ),
    "cpu-smoke": dict(
        hidden=32,
        layers=3,
        heads=4,
        kv_heads=2,
        ffn=48,
        vocab=64,
        seq=16,
        rows=2,
        dtype="float32",
        steps=3,
        warmup=1,
        rounds=2,
    ),
}


def build_stage(p: dict, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model (for its config) and its layers cut as one stage, on ``device``."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        intermediate_size=p["ffn"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=p["seq"],
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, p["dtype"]))
    layers = causal_lm_layers(model)
    (stage,) = pipetrain.split(layers, [len(layers)])
    return model, stage


@contextlib.contextmanager
def per_layer(enabled: bool):
    """While ``enabled``: every layer builds its own mask and rotary table (``BuiltOnce`` off)."""
    if not enabled:
        yield
        return
    original = hf_masks.BuiltOnce.get
    hf_masks.BuiltOnce.get = lambda self, what, sources, build: build()  # type: ignore[method-assign]
    try:
        yield
    finally:
        hf_masks.BuiltOnce.get = original  # type: ignore[method-assign]


@contextlib.contextmanager
def counting_masks(counter: list[int]):
    """Count ``transformers``' causal-mask builds."""
    import transformers.masking_utils as masking

    make = masking.create_causal_mask

    def counted(**kw):
        counter[0] += 1
        return make(**kw)

    masking.create_causal_mask = counted
    try:
        yield
    finally:
        masking.create_causal_mask = make


def run_variant(stage, ids, mask, p: dict, variant: str, device: torch.device) -> dict:
    """``steps`` timed passes after ``warmup``: median ms, mask builds per pass, first loss."""
    builds = [0]
    times, first_loss = [], None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with per_layer(variant == "per-layer"), counting_masks(builds):
        for i in range(p["warmup"] + p["steps"]):
            if i == p["warmup"]:
                builds[0] = 0
            sync()
            start = time.perf_counter()
            logits = stage(ids, attention_mask=mask.clone())
            loss = logits.float().mean()
            loss.backward()
            sync()
            if i >= p["warmup"]:
                times.append(time.perf_counter() - start)
            if first_loss is None:
                first_loss = loss.item()
            stage.zero_grad(set_to_none=True)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "builds_per_pass": builds[0] / p["steps"],
        "first_loss": first_loss,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-2048")
    ap.add_argument("--out", required=True, help="folder for hf_masks.json")
    args = ap.parse_args()
    p = PRESETS[args.preset]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, stage = build_stage(p, device)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, p["vocab"], (p["rows"], p["seq"]), generator=g).to(device)
    mask = torch.ones(p["rows"], p["seq"], dtype=torch.long, device=device)
    mask[0, : p["seq"] // 8] = 0  # left padding on the first row
    rows = []
    for r in range(p["rounds"]):
        order = ["once", "per-layer"] if r % 2 == 0 else ["per-layer", "once"]
        for variant in order:
            row = {
                "round": r,
                "variant": variant,
                **run_variant(stage, ids, mask, p, variant, device),
            }
            rows.append(row)
            print(
                f"round {r} {variant:9s} {row['median_ms']:8.2f} ms  "
                f"{row['builds_per_pass']:.0f} mask builds a pass  loss {row['first_loss']:.6f}",
                flush=True,
            )
        (out / "hf_masks.json").write_text(
            json.dumps({"preset": args.preset, "device": str(device), "rows": rows}, indent=1)
        )
    for variant in ("once", "per-layer"):
        ms = [row["median_ms"] for row in rows if row["variant"] == variant]
        print(f"{variant:9s} median of rounds {statistics.median(ms):8.2f} ms")


if __name__ == "__main__":
    main()
