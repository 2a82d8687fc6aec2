"""torch.compile and torchao float8 under the pipeline against the unsplit model; a benchmark.

The app's GPT (``pipetrain.app.models.gpt``) in bf16, every block compiled on its own (the
per-block ``module.compile()`` torchtitan uses) and/or its linears converted to torchao's
float8 training linears (``convert_to_float8_training``, tensorwise scaling; the head and the
embeddings stay bf16, as torchtitan leaves the output projection). Two parts, one process each:

    python benchmarks/runtime/compile_float8_gpu.py --part unsplit --out $OUT        # GPU 0 alone
    torchrun --nproc-per-node 2 benchmarks/runtime/compile_float8_gpu.py --part pipeline --out $OUT

The unsplit model accumulates gradients over the same micro-batches the pipeline runs (the same
kernel shapes), then the same AdamW step. Per variant: the first step's wall time (compilation
included), the median of the timed steps, the slowest rank's. With ``--stall-dump-s N`` a
stall prints every thread's stack each N seconds (faulthandler), so a run that hangs still says
where.
Rows go to ``<out>/compile_float8-<part>.jsonl`` as they finish (``--launch K`` recorded in each);
``compile_float8_report.py`` turns the launches into the targets with 95% intervals.

CPU dry run (gloo, tiny shape, float8 emulated, the ``aot_eager`` backend):

    python benchmarks/runtime/compile_float8_gpu.py --part unsplit --device cpu --preset tiny
    torchrun --nproc-per-node 2 benchmarks/runtime/compile_float8_gpu.py --part pipeline \
        --device cpu --preset tiny
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import pipetrain
from pipetrain.app.models.gpt import GPTConfig, build_gpt, lm_loss, make_stage

PRESETS = {
    "h2048": dict(hidden=2048, heads=16, layers=8, seq=1024, vocab=32000, mb=4, n=8),
    "h4096": dict(hidden=4096, heads=32, layers=8, seq=1024, vocab=32000, mb=2, n=8),
    "tiny": dict(hidden=64, heads=4, layers=4, seq=32, vocab=128, mb=2, n=4),
}


def float8(module: torch.nn.Module, emulate: bool) -> None:
    """Every block linear to torchao's float8 training linear (the head stays bf16)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        return ".blocks." in f".{fqn}" and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    convert_to_float8_training(
        module, config=Float8LinearConfig(emulate=emulate), module_filter_fn=keep
    )


def prepare(module, variant: dict, device) -> torch.nn.Module:
    module = module.to(
        device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32
    )
    if variant["float8"]:
        float8(module, emulate=device.type != "cuda")
    if variant["compile"]:
        backend = os.environ.get("BACKEND") or (
            "inductor" if device.type == "cuda" else "aot_eager"
        )
        for block in module.blocks.values():
            block.compile(backend=backend)
    return module


def variants(part: str, wanted: str) -> list[dict]:
    out = []
    for name in wanted.split(","):
        base, *flags = name.split("/")
        compile_, f8 = "compile" in base, "float8" in base
        defer = True if "defer-on" in flags else False if "defer-off" in flags else None
        if part == "unsplit" and flags:
            continue
        out.append(
            dict(name=name, compile=compile_, float8=f8, defer=defer, pre="precompile" in flags)
        )
    return out


def timed(step, sync, steps: int, warmup: int) -> dict:
    sync()
    t = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t)
    return {"first_s": first, "times": times}


def make_step(args, variant: dict, cfg: GPTConfig, x, y, device, world: int):
    """One training step of the variant (the unsplit model, or this rank's pipeline), with
    AdamW; returns the loss."""
    n = PRESETS[args.preset]["n"]
    if args.part == "unsplit":
        model = prepare(build_gpt(cfg), variant, device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)

        def step():
            total = 0.0
            for xs, ys in zip(x.chunk(n), y.chunk(n)):
                loss = lm_loss(model(xs), ys) / n
                loss.backward()
                total += loss.detach()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return total

        return step
    from pipetrain.schedule.registry import family

    v = family(args.schedule).default_stages_per_rank
    num_stages = v * world
    pipe = pipetrain.Pipeline(
        lambda s: prepare(make_stage(cfg, s, num_stages), variant, device),
        args.schedule,
        n,
        lm_loss,
        stages_per_rank=v,
        num_stages=num_stages,
        device=device,
        timeout=timedelta(seconds=150),
        defer_weight_grads=variant["defer"],
        precompile=variant["pre"],
    )
    popt = torch.optim.AdamW(pipe.parameters(), lr=1e-5, foreach=True)

    def pipeline_step():
        loss = pipe.step(x, y)
        popt.step()
        popt.zero_grad(set_to_none=False)
        return loss

    return pipeline_step


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=("unsplit", "pipeline"), required=True)
    p.add_argument("--preset", choices=sorted(PRESETS), default="h2048")
    p.add_argument("--schedule", default="zbv")
    p.add_argument(
        "--variants",
        default="eager,compile,float8,compile+float8",
        help="comma list of eager|compile|float8|compile+float8, each optionally /defer-on or "
        "/defer-off and/or /precompile (pipeline part only: Pipeline(defer_weight_grads=..., "
        "precompile=True))",
    )
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--launch", type=int, default=0, help="recorded in each row (the report pools)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument(
        "--stall-dump-s",
        type=float,
        default=0.0,
        help="print every thread's stack each N s (0: off; one run died right after a dump)",
    )
    return p.parse_args()


def start(part: str, cuda: bool) -> tuple[torch.device, int, int]:
    """This process's device, rank and world size: the pipeline part joins the process group
    (NCCL, or gloo on the CPU), the unsplit part runs alone on the first GPU."""
    rank, world = 0, 1
    if part == "pipeline":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            timeout=timedelta(seconds=150),
            device_id=device if cuda else None,
        )
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    return device, rank, world


def main() -> int:
    args = arguments()
    if args.stall_dump_s > 0:
        faulthandler.dump_traceback_later(args.stall_dump_s, repeat=True, file=sys.stderr)
    shape = PRESETS[args.preset]
    cfg = GPTConfig(
        vocab_size=shape["vocab"],
        seq_len=shape["seq"],
        num_layers=shape["layers"],
        hidden=shape["hidden"],
        num_heads=shape["heads"],
    )
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device, rank, world = start(args.part, cuda)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    n, mb = shape["n"], shape["mb"]
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (n * mb, cfg.seq_len), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (n * mb, cfg.seq_len), generator=g).to(device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for variant in variants(args.part, args.variants):
        if rank == 0:
            print(
                f"[{time.perf_counter() - t0:6.1f}s] {args.part} {variant['name']} ...", flush=True
            )
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        step = make_step(args, variant, cfg, x, y, device, world)
        row = timed(step, sync, args.steps, args.warmup)
        loss = step()
        if args.part == "pipeline":
            everyone: list = [None] * world
            dist.all_gather_object(everyone, row)
            row = {
                "first_s": max(r["first_s"] for r in everyone),
                "times": [max(ts) for ts in zip(*(r["times"] for r in everyone))],
            }
        graphs = dict(torch._dynamo.utils.counters["stats"])
        row.update(
            graphs=graphs,
            part=args.part,
            variant=variant["name"],
            preset=args.preset,
            launch=args.launch,
            schedule=args.schedule if args.part == "pipeline" else None,
            median_ms=1e3 * statistics.median(row["times"]),
            loss=float(loss) if loss is not None else None,
            peak_gib=torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
            device=torch.cuda.get_device_name(device) if cuda else "cpu",
            date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        )
        if rank == 0:
            print(
                f"[{time.perf_counter() - t0:6.1f}s]   first step {row['first_s']:.1f} s, "
                f"median {row['median_ms']:.1f} ms, loss {row['loss']}, dynamo {graphs}",
                flush=True,
            )
            with open(out / f"compile_float8-{args.part}.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        del step
    faulthandler.cancel_dump_traceback_later()
    if args.part == "pipeline":
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
