"""A mixture-of-experts folder fine-tuned by ``pipetrain train`` on one GPU, eager against
``--compile``: the same losses (within bf16's rounding) and the tokens per second of each. A
benchmark, not a test.

    python benchmarks/moe/moe_compile_gpu.py --out $OUT                     # one GPU, bf16
    python benchmarks/moe/moe_compile_gpu.py --preset cpu-smoke --out /tmp/mc  # CPU, a minute

The folder is a Qwen3-MoE of random weights (``--preset gpu``: hidden 512, 4 layers, 16 experts,
top-4, a 4,096-token byte-level BPE tokenizer trained on the text) and the data short lines of
made-up words (``benchmarks/data/packed_tokens_gpu.py``'s text), packed into rows of 512. Both
runs take the same flags (``-p 1``, 4 micro-batches of 2 rows, a constant learning rate, fixed
micro-batches) and differ only by ``--compile``; on the GPU the experts run on ``grouped_mm``
(``--experts auto``), compiled or not.

The check: the first step's losses agree to :data:`FIRST_STEP` (relative; the same weights and
batch, other kernels), and the means of the last five steps to :data:`LAST_STEPS` (bf16 rounding
compounds through the updates). Tokens per second: the median over the steps after
``--warmup`` (the first steps compile), with the lowest and highest.

Writes ``results.json`` and ``results.md`` (the table) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.data.packed_tokens_gpu import write_text, write_tokenizer

#: the first step's relative loss difference allowed between eager and compiled
FIRST_STEP = 1e-3
#: the relative difference allowed between the means of the last five steps' losses
LAST_STEPS = 1e-2

PRESETS = {
    "gpu": dict(
        device="cuda",
        dtype="bfloat16",
        vocab=4096,
        hidden=512,
        layers=4,
        heads=8,
        kv_heads=4,
        head_dim=64,
        experts=16,
        top_k=4,
        seq=512,
        lines=6000,
        steps=20,
        warmup=5,
    ),
    "cpu-smoke": dict(
        device="cpu",
        dtype="float32",
        vocab=512,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        experts=8,
        top_k=2,
        seq=128,
        lines=400,
        steps=6,
        warmup=1,
    ),
}
RUNS = {"eager": [], "compiled": ["--compile"]}


def write_folder(folder: Path, text: Path, p: dict) -> None:
    """A Qwen3-MoE folder of random weights in ``p["dtype"]`` with a tokenizer trained on ``text``."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = write_tokenizer(folder, text, p)
    config = Qwen3MoeConfig(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        intermediate_size=2 * p["hidden"],
        moe_intermediate_size=p["hidden"] // 2,
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        head_dim=p["head_dim"],
        num_experts=p["experts"],
        num_experts_per_tok=p["top_k"],
        norm_topk_prob=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=p["seq"],
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).to(getattr(torch, p["dtype"])).save_pretrained(folder)


def train(name: str, folder: Path, text: Path, p: dict, out: Path) -> list[dict]:
    """One ``pipetrain train`` run of the folder; its metrics records (one per step)."""
    metrics = out / f"{name}.jsonl"
    cmd = [sys.executable, "-m", "pipetrain", "train", "--device", p["device"], "-p", "1"]
    cmd += ["--model-dir", str(folder), "--data", str(text), "--seq-len", str(p["seq"])]
    cmd += ["--microbatch-size", "2", "-m", "4", "--dtype", p["dtype"], "--steps", str(p["steps"])]
    cmd += ["--lr", "1e-3", "--lr-schedule", "constant", "--warmup", "0"]
    cmd += ["--microbatch-balance", "fixed", "--timeout", "300", "--metrics", str(metrics)]
    cmd += ["--data-cache", str(out / "data-cache"), "--svg", str(out / f"{name}.svg"), *RUNS[name]]
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    print(f"{name}: exit {done.returncode} after {time.perf_counter() - start:.1f} s", flush=True)
    print("\n".join(x for x in done.stdout.splitlines() if x.startswith(("experts", "loss"))))
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def summary(records: dict[str, list[dict]], warmup: int) -> dict:
    """Tokens per second per run (median, lowest, highest after ``warmup`` steps) and the check."""
    eager, compiled = ([r["loss"] for r in records[k]] for k in RUNS)
    first = abs(compiled[0] - eager[0]) / eager[0]
    last = abs(statistics.fmean(compiled[-5:]) - statistics.fmean(eager[-5:]))
    last /= statistics.fmean(eager[-5:])
    speed = {}
    for name, recs in records.items():
        tok = [r["tok_per_s"] for r in recs[warmup:]]
        speed[name] = {"median": statistics.median(tok), "low": min(tok), "high": max(tok)}
    return {
        "tok_per_s": speed,
        "compiled_over_eager": speed["compiled"]["median"] / speed["eager"]["median"],
        "first_step_rel": first,
        "last_steps_rel": last,
        "losses": {"eager": eager, "compiled": compiled},
        "ok": first <= FIRST_STEP and last <= LAST_STEPS,
    }


def table(result: dict) -> str:
    rows = [
        "| run | tok/s median [lowest, highest] | loss first → mean of last 5 |",
        "|---|---|---|",
    ]
    for name in RUNS:
        s, losses = result["tok_per_s"][name], result["losses"][name]
        rows.append(
            f"| {name} | {s['median']:,.0f} [{s['low']:,.0f}, {s['high']:,.0f}] | "
            f"{losses[0]:.4f} → {statistics.fmean(losses[-5:]):.4f} |"
        )
    rows.append("")
    rows.append(
        f"compiled / eager: {result['compiled_over_eager']:.2f} ×; first step's losses "
        f"{result['first_step_rel']:.1e} apart (≤ {FIRST_STEP:g}), last five steps' means "
        f"{result['last_steps_rel']:.1e} (≤ {LAST_STEPS:g}): {'ok' if result['ok'] else 'FAILED'}"
    )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    p = PRESETS[args.preset]
    args.out.mkdir(parents=True, exist_ok=True)
    text, folder = args.out / "text.txt", args.out / "qwen3-moe"
    write_text(text, p["lines"])
    write_folder(folder, text, p)
    records = {name: train(name, folder, text, p, args.out) for name in RUNS}
    result = {"preset": args.preset, "shape": p, **summary(records, p["warmup"])}
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    said = table(result)
    (args.out / "results.md").write_text(said)
    print(said)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
