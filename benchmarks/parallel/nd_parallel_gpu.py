"""Training throughput of one world laid out three ways: (pp, tp) = (2, 2), (4, 1) and (1, 4).

    torchrun --nproc-per-node 4 benchmarks/parallel/nd_parallel_gpu.py --out $OUT/nd.json        # 4 GPUs
    torchrun --nproc-per-node 4 benchmarks/parallel/nd_parallel_gpu.py --sequence-parallel ...  # tp with SP
    torchrun --nproc-per-node 4 benchmarks/parallel/nd_parallel_gpu.py --preset cpu-smoke       # CPU, gloo

A Llama-shaped ``transformers`` model with random weights (``LlamaConfig``; the ``h100`` preset:
hidden 2048, 16 heads, 8 key/value heads, SwiGLU 5632, 8 layers, vocabulary 32000, sequence 2048,
bf16, SDPA attention) trains the same global batch (``--microbatches`` × ``--mb-size`` sequences)
under each layout of the ``("pp", "tp")`` mesh, the docs/training.md "The N-D mesh" recipe:
``pipetrain.hf.causal_lm_layers`` → ``pipetrain.hf.parallelize_causal_lm`` on ``mesh["tp"]``
(where tp > 1; ``--sequence-parallel`` shards the norms' tokens) → ``pipetrain.split`` into
pp stages balanced by parameter count → ``pipetrain.Pipeline(mesh=mesh)``. One step is
``pipe.step`` + ``pipe.clip_grad_norm_`` + AdamW (foreach) + ``zero_grad``; each layout runs
``--warmup`` steps, then ``--steps`` timed ones (barrier, synchronize, step, synchronize; a step's
time is the slowest process's). tp = 1 layouts are not parallelized (plain tensors); pp = 1
layouts are a one-stage pipeline (gradient accumulation over the micro-batches).

Reported per layout: step ms (median, min–max), tokens/s, model TFLOP/s per GPU (6·P + 12·L·s·h
per token, P the parameters but the embedding, the PaLM/Megatron convention), peak GPU memory per
process, the losses of the timed steps. Needs ``transformers>=5.24`` (pipetrain's ``hf`` extra;
older ones lack the ``create_causal_mask`` signature ``pipetrain.hf`` calls): where the machine's
image holds an older one, carry the wheel and put it first on ``PYTHONPATH``. Layouts whose tp
does not divide the heads or the world are left out with a reason; a layout that fails becomes
an error row and the next one runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import pipetrain  # noqa: E402
from pipetrain.hf import causal_lm_layers, causal_lm_loss, parallelize_causal_lm  # noqa: E402

PRESETS = {
    "h100": dict(
        vocab=32000,
        hidden=2048,
        heads=16,
        kv_heads=8,
        intermediate=5632,
        layers=8,
        seq=2048,
        mb_size=1,
        microbatches=16,
        dtype="bfloat16",
        steps=10,
        warmup=3,
    ),
    "cpu-smoke": dict(
        vocab=256,
        hidden=64,
        heads=4,
        kv_heads=4,
        intermediate=128,
        layers=2,
        seq=16,
        mb_size=1,
        microbatches=4,
        dtype="float32",
        steps=3,
        warmup=1,
    ),
}


#: (name, pp, tp) of a 4-process world; other worlds: (pp=2, tp=W/2), (pp=W, 1), (1, tp=W)
def default_layouts(world: int) -> list[tuple[str, int, int]]:
    out = []
    for pp, tp in ((2, world // 2), (world, 1), (1, world)):
        if pp * tp != world or (pp, tp) in [(p, t) for _, p, t in out]:
            continue
        name = "-".join(f"{d}{n}" for d, n in (("pp", pp), ("tp", tp)) if n > 1) or "pp1"
        out.append((name, pp, tp))
    return out


def parse_layout(text: str) -> tuple[str, int, int]:
    """'pp2-tp2', 'pp4', 'tp4' → (name, pp, tp)."""
    pp = tp = 1
    for part in text.split("-"):
        if part.startswith("pp"):
            pp = int(part[2:])
        elif part.startswith("tp"):
            tp = int(part[2:])
        else:
            raise SystemExit(f"layout {text!r}: parts are ppN and tpN, e.g. pp2-tp2, pp4, tp4")
    return text, pp, tp


def build_model(cfg: dict, device: torch.device, dtype: torch.dtype):
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=cfg["vocab"],
        hidden_size=cfg["hidden"],
        intermediate_size=cfg["intermediate"],
        num_hidden_layers=cfg["layers"],
        num_attention_heads=cfg["heads"],
        num_key_value_heads=cfg["kv_heads"],
        max_position_embeddings=cfg["seq"],
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)  # the same weights in every process (tensor parallel shards them)
    with torch.device(device):
        model = tf.LlamaForCausalLM(config)
    return model.to(dtype).train()


def flops_per_token(model, cfg: dict) -> float:
    embed = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embed
    return 6 * params + 12 * cfg["layers"] * cfg["seq"] * cfg["hidden"]


def balanced(layers: dict, num_stages: int) -> list[int]:
    """Consecutive layer counts per stage, balancing parameters (the last stage's loss and head
    weigh in through the head's parameters); every stage gets at least one layer."""
    weights = [max(1, sum(p.numel() for p in m.parameters())) for m in layers.values()]
    total, counts, start = sum(weights), [], 0
    for s in range(num_stages):
        left_stages = num_stages - s
        if left_stages == 1:
            counts.append(len(weights) - start)
            break
        target = sum(weights[start:]) / left_stages
        end, acc = start, 0
        while end < len(weights) - (left_stages - 1):
            if acc and abs(acc + weights[end] - target) > abs(acc - target):
                break
            acc += weights[end]
            end += 1
        counts.append(end - start)
        start = end
    assert sum(counts) == len(weights) and min(counts) >= 1 and total > 0, counts
    return counts


class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cuda = torch.cuda.is_available() and args.device == "auto"
        local = int(os.environ.get("LOCAL_RANK", 0))
        if self.cuda:
            torch.cuda.set_device(local)
        self.device = torch.device("cuda", local) if self.cuda else torch.device("cpu")
        dist.init_process_group(
            "nccl" if self.cuda else "gloo",
            timeout=timedelta(seconds=args.pg_timeout),
            device_id=self.device if self.cuda else None,
        )
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[nd_parallel] {msg}", flush=True)

    def gather(self, value):
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out


def run_layout(ctx: Ctx, name: str, pp: int, tp: int, cfg: dict, dtype: torch.dtype) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    a = ctx.args
    row: dict = {"layout": name, "pp": pp, "tp": tp, "schedule": a.schedule if pp > 1 else "1f1b"}
    if cfg["heads"] % tp or cfg["kv_heads"] % tp or cfg["intermediate"] % tp:
        return row | {"skipped": f"tp={tp} does not divide the heads or the MLP"}
    sp = a.sequence_parallel and tp > 1
    row["sequence_parallel"] = sp
    base = fresh_peak(ctx)
    mesh = init_device_mesh(ctx.device.type, (pp, tp), mesh_dim_names=("pp", "tp"))
    model = build_model(cfg, ctx.device, dtype)
    fpt = flops_per_token(model, cfg)
    layers = causal_lm_layers(model)
    if tp > 1:
        parallelize_causal_lm(layers, mesh["tp"], sequence_parallel=sp)
    v = 2 if row["schedule"] in ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev") else 1
    counts = balanced(layers, pp * v) if pp > 1 else [len(layers)]
    row["stage_layers"] = counts
    row["engine"], row["defer"] = a.engine, a.defer
    if a.engine == "plain":  # torch alone: the layers in one module, gradient accumulation
        if pp > 1:
            return row | {"skipped": "--engine plain runs pp=1 layouts only"}
        pipe = PlainAccumulation(pipetrain.split(layers, [len(layers)])[0], a.microbatches)
    else:
        pipe = pipetrain.Pipeline(
            pipetrain.split(layers, counts),
            row["schedule"],
            a.microbatches,
            causal_lm_loss,
            stages_per_rank=v,
            mesh=mesh,
            device=ctx.device,
            timeout=timedelta(seconds=a.op_timeout),
            defer_weight_grads={"auto": None, "on": True, "off": False}[a.defer],
        )
    del model, layers  # only this process's stages stay (in pipe.modules)
    gc.collect()
    params = [p for p in pipe.parameters() if p.requires_grad]
    opts = optimizers(params)
    rows = a.microbatches * a.mb_size
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (rows, cfg["seq"]), generator=g).to(ctx.device)
    losses: list[float] = []

    def step() -> None:
        loss = pipe.step(ids, ids)
        if a.clip > 0:
            pipe.clip_grad_norm_(a.clip)
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=False)
        losses.append(loss)

    for _ in range(a.warmup):
        step()
    ctx.sync()
    if a.profile_dir:  # one profiled step: where the time goes (rank 0's table)
        profile_step(ctx, Path(a.profile_dir) / f"{name}-{a.engine}-{a.defer}.txt", step)
    ms = timed_ms(ctx, a.steps, step)
    tokens = rows * cfg["seq"]
    med = statistics.median(ms)
    row |= {
        "median_ms": med,
        "min_ms": min(ms),
        "max_ms": max(ms),
        "step_ms": ms,
        "tokens_per_step": tokens,
        "tokens_per_s": tokens / (med / 1e3),
        "tflops_per_gpu": fpt * tokens / (med / 1e3) / ctx.world / 1e12,
        "losses": [float(x) for x in losses[a.warmup :] if x is not None],
        "params_per_rank": ctx.gather(sum(p.numel() for p in params)),
    }
    if ctx.cuda:
        peak = torch.cuda.max_memory_allocated(ctx.device) - base
        row["peak_gib"] = [v / 2**30 for v in ctx.gather(peak)]
    pipe.close()  # the stages, optimizers and buffers go when this function returns
    return row


def fresh_peak(ctx: Ctx) -> int:
    """Bytes allocated before a layout builds anything, with the peak counter reset (0 on CPU)."""
    if not ctx.cuda:
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(ctx.device)
    return torch.cuda.memory_allocated(ctx.device)


def optimizers(params: list) -> list[torch.optim.Optimizer]:
    """AdamW over the parameters: foreach kernels (the step and zero_grad's) take DTensors or
    plain tensors, not both, so one optimizer for each kind (the norms stay plain tensors under
    tensor parallel without sequence parallel)."""
    from torch.distributed.tensor import DTensor

    kinds = [[p for p in params if isinstance(p, DTensor) == d] for d in (True, False)]
    return [torch.optim.AdamW(g, lr=1e-5, foreach=True) for g in kinds if g]


def profile_step(ctx: Ctx, out: Path, step: Callable[[], None]) -> None:
    """One profiled step; rank 0 writes its operators by host time and by device time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=acts) as prof:
        step()
        ctx.sync()
    if ctx.rank == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        key = "self_cuda_time_total" if ctx.cuda else "self_cpu_time_total"
        out.write_text(
            prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n\n"
            + prof.key_averages().table(sort_by=key, row_limit=25)
        )


def timed_ms(ctx: Ctx, steps: int, step: Callable[[], None]) -> list[float]:
    """Each timed step's wall time in ms, the slowest rank's."""
    times = []
    for _ in range(steps):
        dist.barrier()
        ctx.sync()
        t = time.perf_counter()
        step()
        ctx.sync()
        times.append(time.perf_counter() - t)
    slowest = torch.tensor(times, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [1e3 * t for t in slowest.tolist()]


class PlainAccumulation:
    """The reference without pipetrain: one module of every layer, each micro-batch's forward
    and backward in turn (what a torchtitan user runs with tp alone); ``step`` as the pipeline's."""

    def __init__(self, module: torch.nn.Module, microbatches: int) -> None:
        self.module, self.m = module, microbatches

    def parameters(self):
        return self.module.parameters()

    def step(self, ids: torch.Tensor, labels: torch.Tensor) -> float:
        total = 0.0
        for x, y in zip(ids.chunk(self.m), labels.chunk(self.m), strict=True):
            loss = causal_lm_loss(self.module(x), y) / self.m
            loss.backward()
            total += loss.detach()
        return float(total)

    def clip_grad_norm_(self, max_norm: float):
        # torch's clip_grad_norm_ refuses a mix of DTensors and plain tensors (the norms stay
        # plain without SP): each gradient's norm, DTensor ones made whole, then one scale
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        norms = [g.norm(dtype=torch.float32) for g in grads]
        norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
        total = torch.stack(norms).norm()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
        return total

    def close(self) -> None:
        pass


def guarded(ctx: Ctx, fn) -> dict:
    """``fn()`` on every process; any process's exception becomes the row's error (agreed)."""
    try:
        row, err = fn(), None
    except Exception as e:
        row, err = {}, f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if ctx.args.verbose:
            traceback.print_exc()
    errors = [e for e in ctx.gather(err) if e]
    return {"error": errors[0]} if errors else row


def table(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"{meta['device']} × {meta['world']}, {meta['dtype']}, {meta['tokens_per_step']} tokens "
        f"per step ({meta['microbatches']} micro-batches × {meta['mb_size']} × seq {meta['seq']})",
        "",
        "| layout | schedule | SP | step ms med [min–max] | tokens/s | TFLOP/s/GPU | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "median_ms" not in r:
            why = r.get("error") or r.get("skipped")
            lines.append(f"| {r['layout']} | {why} |")
            continue
        peak = "/".join(f"{v:.1f}" for v in r["peak_gib"]) if "peak_gib" in r else "-"
        lines.append(
            f"| {r['layout']} | {r['schedule']} | {'yes' if r['sequence_parallel'] else 'no'} | "
            f"{r['median_ms']:.1f} [{r['min_ms']:.1f}–{r['max_ms']:.1f}] | "
            f"{r['tokens_per_s']:.0f} | {r['tflops_per_gpu']:.1f} | {peak} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: h100 on GPU")
    p.add_argument("--out", default=None, help="JSON file (rank 0 writes it)")
    p.add_argument("--layouts", default=None, help="comma list, e.g. pp2-tp2,pp4,tp4 (default)")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule where pp > 1")
    p.add_argument("--sequence-parallel", action="store_true", help="tp with sequence parallel")
    p.add_argument("--clip", type=float, default=1.0, help="clip_grad_norm_ max norm (0: off)")
    for name in ("vocab", "hidden", "heads", "kv-heads", "intermediate", "layers", "seq",
                 "mb-size", "microbatches", "steps", "warmup"):  # fmt: skip
        p.add_argument(f"--{name}", type=int, default=None, help="overrides the preset")
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 (overrides the preset)")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--op-timeout", type=float, default=60.0, help="pipetrain wait timeout (s)")
    p.add_argument("--pg-timeout", type=float, default=300.0, help="process-group timeout (s)")
    p.add_argument(
        "--engine",
        choices=("pipetrain", "plain"),
        default="pipetrain",
        help="plain: torch alone, gradient accumulation (pp=1 layouts)",
    )
    p.add_argument(
        "--defer",
        choices=("auto", "on", "off"),
        default="auto",
        help="Pipeline(defer_weight_grads=): auto (None), on (True), off (False)",
    )
    p.add_argument("--profile-dir", default=None, help="a torch.profiler table per layout here")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and args.device == "auto"
    preset = PRESETS[args.preset or ("h100" if cuda else "cpu-smoke")]
    args.preset = args.preset or ("h100" if cuda else "cpu-smoke")
    for key, value in preset.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = Ctx(args)
    cfg = {k: getattr(args, k) for k in
           ("vocab", "hidden", "heads", "kv_heads", "intermediate", "layers", "seq")}  # fmt: skip
    dtype = getattr(torch, args.dtype)
    if args.layouts:
        layouts = [parse_layout(s) for s in args.layouts.split(",") if s]
    else:
        layouts = default_layouts(ctx.world)
    meta = {
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu",
        "backend": dist.get_backend(),
        "world": ctx.world,
        "torch": torch.__version__,
        "preset": args.preset,
        "model": "LlamaForCausalLM, random weights, SDPA",
        **cfg,
        "dtype": args.dtype,
        "mb_size": args.mb_size,
        "microbatches": args.microbatches,
        "tokens_per_step": args.microbatches * args.mb_size * args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "clip": args.clip,
        "optimizer": "AdamW foreach (one for the DTensor parameters, one for the plain ones), "
        "zero_grad(set_to_none=False)",
        "timing": "per step: barrier, synchronize, step + clip + AdamW, synchronize; the slowest "
        "process's time; median over the timed steps",
        "flops_formula": "6*P + 12*L*s*h per token; P = parameters but the embedding",
        "argv": sys.argv,
    }
    ctx.log(f"{meta['device']} × {ctx.world}, torch {torch.__version__}, {cfg}, {args.dtype}")
    rows = []
    for name, pp, tp in layouts:
        if pp * tp != ctx.world:
            rows.append({"layout": name, "pp": pp, "tp": tp,
                         "skipped": f"pp × tp = {pp * tp}, world {ctx.world}"})  # fmt: skip
            continue
        t = time.perf_counter()
        row = guarded(ctx, lambda n=name, p=pp, q=tp: run_layout(ctx, n, p, q, cfg, dtype))
        row = {"layout": name, "pp": pp, "tp": tp} | row
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        shown = {k: row[k] for k in ("median_ms", "tokens_per_s", "error", "skipped") if k in row}
        ctx.log(f"{name}: {shown}")
        if ctx.rank == 0 and args.out:
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    if ctx.rank == 0:
        print(table(meta, rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Every rank has met in the last barrier and the results are written: leave without the
    # interpreter's teardown, which frees torch's C++ objects in no defined order (a rank of
    # plan_gpu.py's CPU smoke run aborted there once, 2026-11-28, after its work was done).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
