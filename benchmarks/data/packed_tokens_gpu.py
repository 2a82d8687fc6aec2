"""Real tokens per second of a fine-tune on ordinary short lines: ``pipetrain train --model-dir``
(packed documents, ``-p 1``) against a plain loop over ``transformers``' own
``AutoModelForCausalLM`` fed the very same packed rows, position ids and document mask, with the
same attention implementation, dtype and optimizer. A benchmark, not a test.

    python benchmarks/data/packed_tokens_gpu.py --out $OUT                     # one GPU
    python benchmarks/data/packed_tokens_gpu.py --preset cpu-smoke --out /tmp/packed   # CPU, a minute
    python benchmarks/data/packed_tokens_gpu.py --host-only --out /tmp/host   # the GPU preset's host share, on a CPU

It writes a Llama-shaped folder (random weights from a config, its own byte-level BPE tokenizer
trained on the text) and a text file of short lines (5 to 40 words each), then runs, in turn:

* ``padded``: ``pipetrain train --packing none`` (each line one row right-padded to
  ``--seq-len``: what the command did before packing);
* ``packed``: ``pipetrain train`` with its defaults (documents packed, length-aware
  micro-batches, the next step's batch built on a background thread while a step runs);
* ``packed-sync``: the same with ``--prefetch-batches 0``: each batch built in the loop, between
  steps (the prefetch's gain is ``packed`` over this);
* ``plain``: a loop over ``AutoModelForCausalLM`` on the rows ``pipetrain.app.data`` gives the
  packed run for the same steps, each micro-batch's forward and backward in turn, the gradient
  norm (which pipetrain measures for ``--metrics``), then AdamW.

``--runs`` names the launches in order (e.g. ``plain,packed,packed,plain``: each kind both early
and late in the call); a ratio is over the median of the plain launches.

Before the runs it times the host's share alone: ``next()`` of the packed run's own batch iterator
(``pipetrain.app.batch_source.train_batches``, the loop's, at the preset's shapes) over
``--host-steps`` steps, no model: planning the step's documents and copying them into rows,
targets and position ids. That per-step time is what ``packed-sync`` adds to every step and
``packed`` hides behind the device (a CPU-measurable number; ``host_batch_ms`` in the JSON).

Each run's real tokens per second is the median over its timed steps (the first ``--warmup``
steps dropped). The two pipetrain runs report theirs through ``--metrics``; the plain loop
synchronises the device around each step. Writes ``packed_tokens.json`` and the runs' logs under
``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

PRESETS = {
    # the shape the tokens issue measured on: 16 x 2048 Llama (0.9 B parameters), bf16
    "llama-2048": dict(
        hidden=2048,
        layers=16,
        heads=16,
        kv_heads=8,
        ffn=5632,
        vocab=32000,
        seq=2048,
        mbs=2,
        microbatches=8,
        dtype="bfloat16",
        steps=30,
        warmup=5,
        lines=200_000,
        device="cuda",
    ),
    "cpu-smoke": dict(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=128,
        vocab=512,
        seq=128,
        mbs=2,
        microbatches=2,
        dtype="float32",
        steps=6,
        warmup=2,
        lines=3000,
        device="cpu",
    ),
}


def write_text(path: Path, lines: int, seed: int = 0) -> None:
    """Short lines of 5 to 40 words over a Zipf-like vocabulary of made-up words."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(5000)]
    weights = [1 / (i + 1) for i in range(len(words))]
    with path.open("w") as f:
        for _ in range(lines):
            n = rng.randint(5, 40)
            f.write(" ".join(rng.choices(words, weights, k=n)).capitalize() + ".\n")


def write_folder(folder: Path, text: Path, p: dict) -> None:
    """A Llama folder of random weights and a byte-level BPE tokenizer trained on ``text``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = write_tokenizer(folder, text, p)
    config = LlamaConfig(
        vocab_size=p["vocab"],
        hidden_size=p["hidden"],
        intermediate_size=p["ffn"],
        num_hidden_layers=p["layers"],
        num_attention_heads=p["heads"],
        num_key_value_heads=p["kv_heads"],
        max_position_embeddings=p["seq"],
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        pad_token_id=tok.token_to_id("<pad>"),
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(getattr(torch, p["dtype"]))
    model.save_pretrained(folder)


def write_tokenizer(folder: Path, text: Path, p: dict):  # type: ignore[no-untyped-def]
    """A byte-level BPE tokenizer of ``p["vocab"]`` tokens trained on ``text``, saved in
    ``folder`` (BOS added to each document, EOS and pad declared); the ``tokenizers`` object."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=p["vocab"], special_tokens=["<s>", "</s>", "<pad>"])
    tok.train([str(text)], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(folder)
    return tok


#: run kind → its flags beside the common ones (``plain`` is not pipetrain's)
RUN_FLAGS = {
    "padded": ["--packing", "none"],
    "packed": [],
    "packed-sync": ["--prefetch-batches", "0"],
}


def train_flags(folder: Path, text: Path, p: dict, out: Path) -> list[str]:
    """The ``pipetrain train`` flags every pipetrain run shares (the shape, data and cache)."""
    flags = ["--device", p["device"], "-p", "1", "--model-dir", str(folder), "--data", str(text)]
    flags += ["--seq-len", str(p["seq"]), "--microbatch-size", str(p["mbs"])]
    flags += ["-m", str(p["microbatches"]), "--dtype", p["dtype"], "--steps", str(p["steps"])]
    return [*flags, "--data-cache", str(out / "data-cache")]


def host_batch_ms(folder: Path, text: Path, p: dict, out: Path, steps: int) -> list[float]:
    """Per step, the ms ``next()`` of the packed run's batch iterator takes on this host:
    ``pipetrain.app.data.train_batches`` with the options ``pipetrain train``'s defaults give it
    (documents packed, micro-batches balanced by a transformer's FLOPs at the preset's width;
    the loop's ``batch_source`` only wraps each batch), the data cache written first, not timed.
    Reads only the folder's tokenizer."""
    from pipetrain.app.data import BatchShape, DataOptions, prepare, train_batches, transformer_cost

    options = DataOptions(seq_len=p["seq"])
    corpus = prepare(text, folder, options, cache_dir=out / "data-cache")
    shape = BatchShape(1, p["microbatches"], p["mbs"])
    batches = train_batches(corpus, options, shape, seed=0, cost=transformer_cost(p["hidden"]))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        next(batches)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def print_host(host: list[float]) -> None:
    print(
        f"host: building a step's batch (next() of train_batches, {len(host)} steps): median "
        f"{statistics.median(host):.2f} ms, mean {statistics.fmean(host):.2f} ms, max "
        f"{max(host):.2f} ms (what packed-sync adds to each step)",
        flush=True,
    )


def host_record(host: list[float]) -> dict:
    return {"median": statistics.median(host), "mean": statistics.fmean(host), "steps": host}


def run_pipetrain(name: str, folder: Path, text: Path, p: dict, out: Path, extra: list[str]):
    """``pipetrain train`` as a user runs it; its metrics lines."""
    metrics = out / f"{name}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pipetrain", "train", *train_flags(folder, text, p, out)]
    cmd += ["--metrics", str(metrics), *extra]
    t0 = time.perf_counter()
    with (out / f"{name}.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"{name}: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
    if rc != 0:
        return None
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def run_plain(folder: Path, text: Path, p: dict, out: Path, attention: str) -> list[dict]:
    """The plain loop over ``AutoModelForCausalLM`` on the packed run's own rows."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipetrain.app.data import BatchShape, DataOptions, prepare, train_batches, transformer_cost

    device = torch.device(p["device"])
    options = DataOptions(seq_len=p["seq"])
    corpus = prepare(text, folder, options, cache_dir=out / "data-cache")
    shape = BatchShape(1, p["microbatches"], p["mbs"])
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, p["dtype"]), attn_implementation=attention
    ).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-5, betas=(0.9, 0.95))
    batches = train_batches(corpus, options, shape, seed=0, cost=transformer_cost(p["hidden"]))
    steps = []
    for step in range(p["steps"]):
        b = next(batches)
        inputs, targets = b.inputs.to(device), b.targets.to(device)
        positions = b.side["position_ids"].to(device)
        count = int((targets != -100).sum())
        sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for i in range(0, inputs.shape[0], p["mbs"]):
            rows = slice(i, i + p["mbs"])
            logits = model(
                input_ids=inputs[rows], position_ids=positions[rows], use_cache=False
            ).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), targets[rows].flatten(), reduction="sum"
            )
            (loss / count).backward()
        # the norm a loop logs (pipetrain measures it for --metrics): one pass over the grads
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        opt.step()
        sync(device)
        dt = time.perf_counter() - t0
        steps.append({"step": step + 1, "tokens": b.real_tokens, "tok_per_s": b.real_tokens / dt})
        print(f"plain step {step + 1}: {b.real_tokens / dt:,.0f} tok/s", flush=True)
    return steps


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(name: str, lines: list[dict] | None, warmup: int) -> dict:
    if not lines:
        return {"run": name, "failed": True}
    timed = lines[warmup:] or lines
    rates = [line["tok_per_s"] for line in timed]
    row = {"run": name, "tok_per_s": statistics.median(rates), "steps": len(timed)}
    pads = [line.get("padding_tokens") for line in timed if line.get("padding_tokens") is not None]
    real = [line["tokens"] for line in timed]
    if pads:
        row["padding_share"] = sum(pads) / (sum(pads) + sum(real))
    mfu = [line.get("mfu") for line in timed if line.get("mfu") is not None]
    if mfu:
        row["mfu"] = statistics.median(mfu)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-2048")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--runs",
        default="padded,packed,packed-sync,plain",
        help="launches in order, of " + ", ".join([*RUN_FLAGS, "plain"]),
    )
    ap.add_argument(
        "--host-only",
        action="store_true",
        help="time the batch iterator alone and stop: needs only the tokenizer, so the GPU "
        "preset's host share is measured on a CPU machine",
    )
    ap.add_argument(
        "--host-steps",
        type=int,
        default=50,
        help="steps of the batch iterator timed alone, before the runs (0: none)",
    )
    ap.add_argument(
        "--attention",
        choices=("flex", "sdpa"),
        default=None,
        help="both sides' attention (default: flex on CUDA, sdpa on the CPU, as pipetrain's rule)",
    )
    args = ap.parse_args()
    p = PRESETS[args.preset]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("PACKED_WORK", "/tmp/packed-tokens")) / args.preset
    work.mkdir(parents=True, exist_ok=True)
    text, folder = work / "lines.txt", work / "model"
    if not text.is_file():
        write_text(text, p["lines"])
    if args.host_only:
        host_only(args.preset, work, text, out, args.host_steps or 50)
        return
    if not (folder / "config.json").is_file():
        write_folder(folder, text, p)
    chosen = args.attention or ("flex" if p["device"] == "cuda" else "sdpa")
    attention = {"flex": "flex_attention", "sdpa": "sdpa"}[chosen]
    runs = args.runs.split(",")
    unknown = sorted(set(runs) - {*RUN_FLAGS, "plain"})
    if unknown:
        ap.error(f"--runs: unknown {', '.join(unknown)}; give {', '.join([*RUN_FLAGS, 'plain'])}")
    host = host_batch_ms(folder, text, p, out, args.host_steps) if args.host_steps else []
    if host:
        print_host(host)
    rows = []
    for launch, name in enumerate(runs):
        if name == "plain":
            row = summary(name, run_plain(folder, text, p, out, attention), p["warmup"])
        else:
            extra = ["--attention", chosen, *RUN_FLAGS[name]]
            lines = run_pipetrain(f"{name}-{launch}", folder, text, p, out, extra)
            row = summary(name, lines, p["warmup"])
        rows.append(row | {"launch": launch})
    result = {"preset": args.preset, "shape": p, "attention": attention, "rows": rows}
    if host:
        result["host_batch_ms"] = host_record(host)
    (out / "packed_tokens.json").write_text(json.dumps(result, indent=1))
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """Each launch's tokens per second against the plain loop's, and the prefetch's gain."""
    plains = [r["tok_per_s"] for r in rows if r["run"] == "plain" and "tok_per_s" in r]
    plain = statistics.median(plains) if plains else None
    print("x plain: over the median of the plain launches")
    print(f"{'launch':6} {'run':11} {'tok/s':>10} {'x plain':>8} {'padding':>8} {'mfu':>6}")
    for r in rows:
        if r.get("failed"):
            print(f"{r['launch']:<6} {r['run']:11} failed (see its log)")
            continue
        ratio = f"{r['tok_per_s'] / plain:.3f}" if plain else "-"
        pad = f"{r['padding_share']:.1%}" if "padding_share" in r else "-"
        mfu = f"{r['mfu']:.1%}" if "mfu" in r else "-"
        print(
            f"{r['launch']:<6} {r['run']:11} {r['tok_per_s']:>10,.0f} {ratio:>8} {pad:>8} {mfu:>6}"
        )
    gain = prefetch_gain(rows)
    if gain:
        print(gain)


def host_only(preset: str, work: Path, text: Path, out: Path, steps: int) -> None:
    """``--host-only``: the batch iterator timed alone, with the preset's tokenizer only."""
    p = PRESETS[preset]
    folder = work / "tokenizer"
    if not (folder / "tokenizer.json").is_file():
        write_tokenizer(folder, text, p)
    host = host_batch_ms(folder, text, p, out, steps)
    print_host(host)
    record = {"preset": preset, "shape": p, "host_batch_ms": host_record(host)}
    (out / "host_batch.json").write_text(json.dumps(record, indent=1))


def prefetch_gain(rows: list[dict]) -> str | None:
    """``packed`` over ``packed-sync``: medians of their launches' tokens per second."""
    rates = {
        kind: [r["tok_per_s"] for r in rows if r["run"] == kind and "tok_per_s" in r]
        for kind in ("packed", "packed-sync")
    }
    if not all(rates.values()):
        return None
    ahead, sync = (statistics.median(rates[k]) for k in ("packed", "packed-sync"))
    return (
        f"prefetch: packed (one batch built ahead) / packed-sync (built in the loop) = "
        f"{ahead / sync:.3f} (medians of {len(rates['packed'])} and {len(rates['packed-sync'])} "
        "launches)"
    )


if __name__ == "__main__":
    main()
