"""How long a checkpoint stalls training: a synchronous save against ``--async-checkpoint``'s.

One process trains a Llama-shaped model (Hugging Face's ``LlamaForCausalLM`` as its layers, as
``pipetrain train --model llama`` builds it; AdamW) and saves its model and optimizer state
several times each way, writing the same folder ``pipetrain train`` writes (DCP shards,
``SHA256SUMS``, the ``COMPLETE`` marker):

* **synchronous** (``pipetrain.save_checkpoint``): the step waits for the whole write; its stall
  is the save call;
* **in the background** (``runtime.checkpoint_async.AsyncCheckpointer``: ``dcp.async_save`` with
  DCP's stager, pinned memory and a side stream on a GPU): the stall is the save call plus what
  the steps run while the write goes on take beyond the median step without one (the
  optimizer's wait for the copy, and whatever the write takes from the training thread), plus
  any wait left when the steps stop (``--max-steps-per-save``).

The first background save also allocates (and on a GPU pins) its staging copy, which later saves
reuse; it is reported apart, and the target (``--target``: the background stall at most this
fraction of the synchronous one) is held against the median of the later saves.

    python benchmarks/runtime/checkpoint_stall.py --preset gpu          # one GPU: 0.9 B
    python benchmarks/runtime/checkpoint_stall.py --preset cpu          # CPU: ~50 M, no target
    python benchmarks/runtime/checkpoint_stall.py --preset cpu-smoke    # seconds: CI's check

Writes ``checkpoint_stall.json`` under ``--out`` (default ``out/checkpoint_stall``), and the
checkpoints under ``--out``/ckpt (each removed once measured).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Preset:
    blocks: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    batch: int
    saves: int
    warmup: int
    baseline_steps: int
    device: str
    target: float | None


PRESETS = {
    # Llama-3.2-1B's width with a 32 k vocabulary: 12 blocks of 62.9 M + 131 M for the
    # embedding and head = 0.886 B parameters; float32 weights and AdamW's two moments: 10.6 GB
    "gpu": Preset(12, 2048, 16, 8, 32000, 1024, 4, 3, 3, 10, "cuda", 0.10),
    "cpu": Preset(4, 768, 12, 4, 8192, 128, 2, 3, 2, 6, "cpu", None),
    "cpu-smoke": Preset(2, 64, 4, 2, 256, 16, 2, 2, 1, 3, "cpu", None),
}


def build(preset: Preset, device: torch.device):
    """The model (a random ``LlamaForCausalLM`` as its layers in order, as ``pipetrain train
    --model llama`` builds it: MLP 4 × hidden, untied head), its loss, AdamW over it, and one
    batch of tokens."""
    import transformers as tf

    from pipetrain.hf import causal_lm_layers, causal_lm_loss

    config = tf.LlamaConfig(
        vocab_size=preset.vocab,
        hidden_size=preset.hidden,
        intermediate_size=4 * preset.hidden,
        num_hidden_layers=preset.blocks,
        num_attention_heads=preset.heads,
        num_key_value_heads=preset.kv_heads,
        max_position_embeddings=preset.seq_len,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    layers = causal_lm_layers(tf.LlamaForCausalLM(config))
    model = torch.nn.Sequential(*layers.values()).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, preset.vocab, (preset.batch, preset.seq_len), generator=generator)
    return model, causal_lm_loss, opt, tokens.to(device)


def stepper(model, loss_fn, opt, tokens, device: torch.device):
    """One training step, timed to its end on the device (seconds)."""
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else None

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if autocast is not None:
            with autocast:
                loss = loss_fn(model(tokens), tokens)
        else:
            loss = loss_fn(model(tokens), tokens)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    return step


def measure_sync(step, model, opt, folder: Path, saves: int, baseline: float) -> list[dict]:
    from pipetrain.runtime.checkpoint import save_checkpoint

    rows = []
    for i in range(saves):
        path = folder / f"sync-{i}"
        t0 = time.perf_counter()
        save_checkpoint(path, model, opt)
        call = time.perf_counter() - t0
        after = step()  # the next step, for a slowdown the write left behind
        rows.append(_row(i, call, [after], baseline, 0.0, _checked(path, i == 0)))
        shutil.rmtree(path)
    return rows


def measure_async(
    step, model, opt, folder: Path, saves: int, baseline: float, max_steps: int, kind: str
) -> list[dict]:
    from pipetrain.runtime.checkpoint_async import AsyncCheckpointer

    rows = []
    with AsyncCheckpointer(writer=kind) as writer:
        for i in range(saves):
            path = folder / f"async-{kind}-{i}"
            t0 = time.perf_counter()
            writer.save(path, model, opt)
            call = time.perf_counter() - t0
            times = [step()]  # at least one: its optimizer step waits for the copy
            while writer.writing and len(times) < max_steps:
                times.append(step())
            t1 = time.perf_counter()
            writer.wait()
            left = time.perf_counter() - t1
            rows.append(_row(i, call, times, baseline, left, _checked(path, i == 0)))
            rows[-1]["writer"] = kind
            shutil.rmtree(path)
    return rows


def _row(
    i: int, call: float, times: list[float], baseline: float, left: float, checked: bool
) -> dict:
    # what the steps took beyond as many steps without a write (signed per step, so that noise
    # in either direction cancels; the total never below zero)
    extra = max(0.0, sum(times) - baseline * len(times))
    return {
        "save": i,
        "call_s": call,
        "steps_during": len(times),
        "step_extra_s": extra,
        "wait_left_s": left,
        "stall_s": call + extra + left,
        "checked": checked,
    }


def _checked(path: Path, check: bool) -> bool:
    """The checkpoint verifies (structure, marker and every file's SHA-256), where asked."""
    if not check:
        return False
    from pipetrain.runtime import checkpoint_disk, checksums

    checkpoint_disk.verify(path)
    checksums.verify(path)
    return True


def run(
    preset_name: str, out: Path, max_steps: int, target: float | None, writers: list[str]
) -> dict:
    preset = PRESETS[preset_name]
    if preset.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("checkpoint_stall.py: error: --preset gpu needs a GPU (CUDA)")
    device = torch.device(preset.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # the background write gets the other cores
    import torch.distributed as dist

    # a process group of one, as ``pipetrain train``'s workers have (DCP's checkpoint process
    # starts its own from it); its store binds the port it is given by the system
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return _measure(preset_name, preset, device, out, max_steps, target, writers)
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


def _measure(
    preset_name: str,
    preset: Preset,
    device: torch.device,
    out: Path,
    max_steps: int,
    target: float | None,
    writers: list[str],
) -> dict:
    model, loss_fn, opt, tokens = build(preset, device)
    params = sum(p.numel() for p in model.parameters())
    step = stepper(model, loss_fn, opt, tokens, device)
    for _ in range(preset.warmup):  # AdamW's state exists from the first step
        step()
    baseline = statistics.median(step() for _ in range(preset.baseline_steps))
    folder = out / "ckpt"
    folder.mkdir(parents=True, exist_ok=True)
    state_bytes = sum(
        t.numel() * t.element_size()
        for t in [*model.state_dict().values()]
        + [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    )
    sync = measure_sync(step, model, opt, folder, preset.saves, baseline)
    by_writer = {
        kind: measure_async(step, model, opt, folder, preset.saves, baseline, max_steps, kind)
        for kind in writers
    }
    background = by_writer[writers[0]]
    shutil.rmtree(folder, ignore_errors=True)
    sync_stall = statistics.median(r["stall_s"] for r in sync)
    later = [r["stall_s"] for r in background[1:]] or [background[0]["stall_s"]]
    async_stall = statistics.median(later)
    ratio = async_stall / sync_stall
    goal = preset.target if target is None else target
    return {
        "preset": preset_name,
        "shape": asdict(preset),
        "parameters": params,
        "state_bytes": state_bytes,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "machine": {"host": platform.node(), "cpus": _cpus(), "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "baseline_step_s": baseline,
        "sync": sync,
        "async": background,
        "async_by_writer": by_writer,
        "writer": writers[0],
        "sync_stall_s": sync_stall,
        "async_stall_s": async_stall,
        "async_first_stall_s": background[0]["stall_s"],
        "ratio": ratio,
        "target": goal,
        "met": None if goal is None else ratio <= goal,
    }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0


def report(result: dict) -> str:
    lines = [
        f"checkpoint stall, preset {result['preset']}: {result['parameters'] / 1e6:.1f} M "
        f"parameters, {result['state_bytes'] / 1e9:.2f} GB of model and optimizer state, on "
        f"{result['device']}; median step {result['baseline_step_s'] * 1e3:.1f} ms",
        "| save | mode | call s | steps during | extra step s | wait left s | stall s |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    rows = [("sync", r) for r in result["sync"]] + [
        (f"async ({r['writer']})", r) for rows in result["async_by_writer"].values() for r in rows
    ]
    for mode, r in rows:
        lines.append(
            f"| {r['save']} | {mode} | {r['call_s']:.3f} | {r['steps_during']} | "
            f"{r['step_extra_s']:.3f} | {r['wait_left_s']:.3f} | {r['stall_s']:.3f} |"
        )
    verdict = ""
    if result["target"] is not None:
        verdict = f" (target <= {result['target']:.0%}: {'met' if result['met'] else 'MISSED'})"
    lines.append(
        f"median stall: synchronous {result['sync_stall_s']:.3f} s, in the background "
        f"({result['writer']} writer) "
        f"{result['async_stall_s']:.3f} s after the first (first "
        f"{result['async_first_stall_s']:.3f} s): {result['ratio']:.1%} of the synchronous"
        + verdict
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu-smoke")
    parser.add_argument("--out", default="out/checkpoint_stall", help="where the JSON is written")
    parser.add_argument(
        "--max-steps-per-save",
        type=int,
        default=400,
        help="steps run while a background write goes on before waiting for it",
    )
    parser.add_argument(
        "--target", type=float, default=None, help="the ratio to hold (default: the preset's)"
    )
    parser.add_argument(
        "--writers",
        default="thread",
        help="comma-separated background writers to measure, the first held to the target: "
        "thread (DCP's upload thread, the default) or process (DCP's checkpoint process)",
    )
    args = parser.parse_args(argv)
    writers = args.writers.split(",")
    if not writers or any(w not in ("thread", "process") for w in writers):
        parser.error(f"--writers takes thread, process; got {args.writers!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args.preset, out, args.max_steps_per_save, args.target, writers)
    (out / "checkpoint_stall.json").write_text(json.dumps(result, indent=1) + "\n")
    print(report(result))
    print(f"wrote {out / 'checkpoint_stall.json'}")
    return 0 if result["met"] in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
