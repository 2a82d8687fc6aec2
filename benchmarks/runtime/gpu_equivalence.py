"""Exact gradients and a short training run on GPUs, per schedule (docs/benchmarks.md); not a test.

    torchrun --nproc-per-node 2 benchmarks/runtime/gpu_equivalence.py [--out DIR]       # NCCL
    torchrun --nproc-per-node 4 benchmarks/runtime/gpu_equivalence.py --device cpu     # gloo smoke

Per schedule: (1) a float64 GPT on the device, one ``Pipeline.step``; rank 0 gathers every
rank's stage gradients (keyed by global layer, so the union is the whole model's) and compares
loss and every gradient with the unsplit model's ``lm_loss(model(x), y).backward()`` on rank 0:
largest relative error (‖g − g_ref‖ / ‖g_ref‖), which must be ≤ 1e-10. (2) ``--train-steps`` of
AdamW in float32 on the repository's byte corpus (``pipetrain.app.models.data``), tokens/s over the
steps after the first, and whether the loss went down (mean of the last 5 < mean of the first 5).
A failing schedule becomes an error row; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pipetrain.app.models.data import batches, corpus_tensor
from pipetrain.app.models.gpt import GPTConfig, build_gpt, lm_loss, make_stage
from pipetrain.runtime.pipeline import Pipeline

V = {"1f1b": 1, "zb-h1": 1, "interleaved-1f1b": 2, "interleaved-zb": 2, "zbv": 2, "dualpipev": 2}


def setup(device_arg: str):
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and device_arg != "cpu":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    return device


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def split_name(name: str) -> tuple[str, dict]:
    """``dualpipev+overlap``: the schedule, run with ``Pipeline(overlap_pairs=True)``;
    ``zbv+replayw``: with ``Pipeline(defer_weight_grads=False)`` (suffixes combine)."""
    options = {}
    for suffix, option, value in (
        ("+replayw", "defer_weight_grads", False),
        ("+overlap", "overlap_pairs", True),
    ):
        if name.endswith(suffix):
            name, options[option] = name.removesuffix(suffix), value
    return name, options


def pipeline(make, name: str, n: int, v: int, device, options: dict) -> Pipeline:
    """A Pipeline of ``make(stage)`` modules, v stages per rank, on this process group."""
    return Pipeline(
        make,
        name,
        n,
        lm_loss,
        stages_per_rank=v,
        num_stages=v * dist.get_world_size(),
        device=device,
        timeout=timedelta(seconds=60),
        **options,
    )


def equivalence(name: str, n: int, device, rank: int, world: int) -> dict:
    name, options = split_name(name)
    v = V[name]
    cfg = GPTConfig(vocab_size=256, seq_len=32, num_layers=2 * v * world, hidden=64, num_heads=4)
    num_stages = v * world
    gen = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (2 * n, cfg.seq_len), generator=gen).to(device)
    y = torch.randint(0, 256, (2 * n, cfg.seq_len), generator=gen).to(device)
    pipe = pipeline(
        lambda s: make_stage(cfg, s, num_stages, seed=3).double(), name, n, v, device, options
    )
    loss = pipe.step(x, y)
    mine = {
        k: p.grad.detach().cpu()
        for m in pipe.modules.values()
        for k, p in m.named_parameters()
        if p.grad is not None
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    out = {"loss": float(loss)}
    if rank == 0:
        grads: dict[str, torch.Tensor] = {}
        for part in everyone:
            grads.update(part)
        ref = build_gpt(cfg, seed=3).double().to(device)
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        want = {k: p.grad.detach().cpu() for k, p in ref.named_parameters()}
        missing = sorted(set(want) ^ set(grads))
        worst, where = 0.0, ""
        for k in want.keys() & grads.keys():
            err = (grads[k] - want[k]).norm().item() / (want[k].norm().item() or 1.0)
            if err >= worst:
                worst, where = err, k
        out.update(
            loss_rel_err=abs(float(loss) - ref_loss.item()) / abs(ref_loss.item()),
            grad_rel_err=worst,
            grad_rel_err_at=where,
            missing=missing,
            num_params=len(want),
        )
        out["ok"] = out["loss_rel_err"] <= 1e-10 and worst <= 1e-10 and not missing
    return out


def training(name: str, n: int, steps: int, device, world: int, big: bool) -> dict:
    name, options = split_name(name)
    v = V[name]
    if big:
        cfg = GPTConfig(vocab_size=256, seq_len=256, num_layers=8, hidden=512, num_heads=8)
        mb = 8
    else:
        cfg = GPTConfig(vocab_size=256, seq_len=32, num_layers=2 * v * world, hidden=32)
        mb = 2
    num_stages = v * world
    pipe = pipeline(lambda s: make_stage(cfg, s, num_stages, seed=0), name, n, v, device, options)
    params = list(pipe.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    data = batches(corpus_tensor(1 << 16), n * mb, cfg.seq_len, seed=0)
    losses, times = [], []
    for _ in range(steps):
        x, y = next(data)
        dist.barrier()
        sync(device)
        t = time.perf_counter()
        loss = pipe.step(x, y)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t)
        losses.append(float(loss))
    tokens = n * mb * cfg.seq_len
    k = min(5, max(1, steps // 4))
    med = statistics.median(times[1:] or times)
    return {
        "first_loss": statistics.fmean(losses[:k]),
        "last_loss": statistics.fmean(losses[-k:]),
        "went_down": statistics.fmean(losses[-k:]) < statistics.fmean(losses[:k]),
        "tokens_per_s": tokens / med,
        "step_ms": med * 1e3,
        "model": f"{cfg.num_layers}L h{cfg.hidden} s{cfg.seq_len} mb{mb}×{n} fp32",
    }


def guarded(fn) -> dict:
    try:
        res, err = fn(), None
    except Exception as e:
        res, err = {}, f"{type(e).__name__}: {e}".splitlines()[0][:200]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, err)
    errors = [e for e in everyone if e]
    return {"error": errors[0]} if errors else res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--schedules",
        default="1f1b,interleaved-1f1b,zbv,dualpipev,dualpipev+overlap,zbv+replayw",
        help="comma list; NAME+overlap runs NAME with Pipeline(overlap_pairs=True), NAME+replayw "
        "with Pipeline(defer_weight_grads=False)",
    )
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--train-steps", type=int, default=30)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--out", default=None, help="folder for gpu_equivalence.json")
    a = p.parse_args(argv)
    device = setup(a.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    big = device.type == "cuda"
    rows = []
    for name in a.schedules.split(","):
        t = time.perf_counter()
        eq = guarded(lambda name=name: equivalence(name, a.microbatches, device, rank, world))
        tr = guarded(
            lambda name=name: training(name, a.microbatches, a.train_steps, device, world, big)
        )
        rows.append({"schedule": name, "equivalence": eq, "training": tr})
        if rank == 0:
            print(f"{name}: {time.perf_counter() - t:.1f}s", flush=True)
    if rank == 0:
        dev = torch.cuda.get_device_name(device) if big else "cpu"
        lines = [
            "",
            f"## equivalence (float64, rel err vs unsplit, ≤ 1e-10) and training ({dev} × {world}, "
            f"{dist.get_backend()}, torch {torch.__version__}, {a.microbatches} micro-batches)",
            "| schedule | loss rel err | max grad rel err | exact | train loss first→last | down | tok/s | step ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            eq, tr = r["equivalence"], r["training"]
            cells = [r["schedule"]]
            if "error" in eq:
                cells += [eq["error"], "", "FAIL"]
            else:
                cells += [
                    f"{eq['loss_rel_err']:.1e}",
                    f"{eq['grad_rel_err']:.1e}",
                    "OK" if eq["ok"] else f"FAIL {eq['missing'][:3]}",
                ]
            if "error" in tr:
                cells += [tr["error"], "", "", ""]
            else:
                cells += [
                    f"{tr['first_loss']:.3f}→{tr['last_loss']:.3f}",
                    "yes" if tr["went_down"] else "NO",
                    f"{tr['tokens_per_s']:.0f}",
                    f"{tr['step_ms']:.1f}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
        if rows and "model" in rows[0]["training"]:
            lines.append(f"training model: {rows[0]['training']['model']}, AdamW lr 1e-3")
        print("\n".join(lines), flush=True)
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / "gpu_equivalence.json").write_text(json.dumps(rows, indent=1))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
