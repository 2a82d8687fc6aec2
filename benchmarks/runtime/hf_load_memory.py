"""Peak host memory while ``pipetrain.hf.from_pretrained`` loads one rank's stage, against the
bound it promises: the stage's own bytes plus the largest tensor it reads.

    python benchmarks/runtime/hf_load_memory.py                       # Llama, hidden 512, 8 layers, 2 stages
    python benchmarks/runtime/hf_load_memory.py --hidden 1024 --layers 16 --stages 4 --shard-mb 100

Writes a random Llama (``transformers``' ``save_pretrained``, sharded at ``--shard-mb``) to a
temporary folder, then loads each stage in a fresh process (no other stage built): the peak
resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` once the imports are done)
minus the resident set before loading. One row per stage; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(folder: str, counts: list[int], stage: int) -> dict:
    """In this process: load ``stage`` and return its bytes, largest tensor and peak growth."""
    import torch

    import pipetrain.hf

    stages = pipetrain.hf.from_pretrained(folder, counts)
    torch.zeros(1).add_(1)  # the allocator's first arena, before the baseline
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    before = _status("VmRSS")
    module = stages[stage]
    peak = _status("VmHWM") - before
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}.values()
    sizes = [t.numel() * t.element_size() for t in tensors]
    return {
        "stage": stage,
        "layers": list(module.layer_names),
        "own_bytes": sum(sizes),
        "largest_bytes": max(sizes),
        "peak_growth_bytes": peak,
    }


def write_model(folder: str, hidden: int, layers: int, vocab: int, shard_mb: int) -> None:
    import torch
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 256, 1),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size=f"{shard_mb}MB")


def default_counts(layers: int, stages: int) -> list[int]:
    """Blocks spread evenly; the embedding joins the first stage, norm and head the last."""
    base, extra = divmod(layers, stages)
    counts = [base + (s < extra) for s in range(stages)]
    counts[0] += 1
    counts[-1] += 2
    return counts


def run(hidden: int, layers: int, vocab: int, stages: int, shard_mb: int) -> list[dict]:
    rows = []
    counts = default_counts(layers, stages)
    with tempfile.TemporaryDirectory() as folder:
        write_model(folder, hidden, layers, vocab, shard_mb)
        for stage in range(stages):
            code = (
                f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); "
                f"sys.path.insert(0, {str(Path(__file__).parent)!r}); import hf_load_memory as m; "
                f"print(json.dumps(m.measure({folder!r}, {counts!r}, {stage})))"
            )
            done = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            )
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary (default 32000)")
    parser.add_argument("--stages", type=int, default=2, help="stages (default 2)")
    parser.add_argument("--shard-mb", type=int, default=50, help="shard size in MB (default 50)")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    rows = run(args.hidden, args.layers, args.vocab, args.stages, args.shard_mb)
    mib = 2**20
    print("| stage | layers | own MiB | largest MiB | bound MiB | peak growth MiB |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        bound = r["own_bytes"] + r["largest_bytes"]
        print(
            f"| {r['stage']} | {r['layers'][0]} … {r['layers'][-1]} | {r['own_bytes'] / mib:.1f} "
            f"| {r['largest_bytes'] / mib:.1f} | {bound / mib:.1f} "
            f"| {r['peak_growth_bytes'] / mib:.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
