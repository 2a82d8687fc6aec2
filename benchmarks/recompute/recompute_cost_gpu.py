"""Activation checkpointing's cost under the pipeline against the unsplit model's, one launch.

The target: full and selective recompute inside stages cost, under every schedule and both
weight-gradient splits, at most 1.03 x what the same recompute costs the unsplit model, each
relative to no recompute (``quotient = ratio_pipe / ratio_unsplit <= 1.03``): splitting the
backward must not make recompute dearer than it is without a pipeline.

The model: the app's GPT (``pipetrain.app.models.gpt``) as its layer list ``[embedding, block 0,
..., block L-1, head]`` (``gpt_layer``; every rank builds the same weights), by default 8 blocks,
hidden 2048, 16 heads, sequence 1024, vocabulary 8192, bf16; 8 micro-batches of 4 sequences; no
optimizer (its time is no part of recompute's cost, and it differs between one GPU holding the
whole model and a rank holding half). Recompute wraps every layer (``--wrap all``, the default:
a plan's per-stage ``Layout.recompute``, which ``Pipeline.from_plan`` applies with
``recompute_stages``) or only the blocks (``--wrap blocks``: ``recompute_layers``); the unsplit
model wraps the same layers with the same functions. Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models") define full and selective recompute.
``--modes`` adds "whole": every pipeline stage recomputed as one region (``recompute_stage``'s
"whole": its forward without autograd, again before its backward), held against the unsplit
model run the same way (every micro-batch's forward without autograd, then each forward again
with its backward) — the same extra forward with no checkpoint on either side.

1. The unsplit model, on rank 0's GPU alone (rank 1 waits at a barrier of a gloo group; no
   collective runs while it is timed): the layers as one ``Stage``, gradients accumulated over
   the same micro-batches the pipeline runs (each loss divided by their count, as the pipeline
   weighs them), for each recompute of ``--modes`` (default none, full, selective).
2. The pipeline on both ranks, for every family the registry runs on 2 ranks (``--schedules``
   narrows them) x ``defer_weight_grads`` True ("deferred") and False ("replay": graph replay)
   (``--splits``; "default", None, is what the pipeline picks per stage) x each recompute of
   ``--modes``: ``Pipeline.from_plan`` on a ``Layout`` whose cut is
   ``make_stage``'s (blocks as even as possible, the embedding on the first stage, the head on
   the last), stages per rank the family's default.

Per row: the median step ms over ``--steps`` timed steps after ``--warmup`` (a pipeline step is
the slowest rank's, each step between a barrier with synchronisation and a synchronisation; the
per-step zeroing of gradients is timed on both sides alike), each rank's peak allocated GiB
(from before its model was built), the first step's loss and each rank's squared gradient sum.
Recompute changes no value: a row whose first loss differs from its ``none`` row's (or whose
gradient sum differs beyond round-off) is listed under ``mismatches``. One line per row as it
goes; ``recompute_cost.json`` under ``--out`` (``$OUT``) is rewritten after every row, so a run
cut short keeps what it measured. ``--budget-s`` starts no row after that many seconds;
``--row-timeout-s`` stops a row's timed steps early (the steps it timed are kept); ``--timeout-s``
bounds every wait on a peer.

On 2 GPUs, from the repository root (docs/benchmarks.md estimates its time)::

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \\
      timeout 580 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \\
      benchmarks/recompute/recompute_cost_gpu.py --out $OUT

A CPU dry run (gloo, a tiny shape, float32, a few schedules; spawns its 2 processes itself)::

    python benchmarks/recompute/recompute_cost_gpu.py --device cpu
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.local_launch import launch
from benchmarks.recompute.recompute_cost_report import MODES, TARGET, compare, line, summary, write
from pipetrain.app.models.gpt import GPTConfig, gpt_layer, lm_loss, stage_layers
from pipetrain.planner.layout import Layout
from pipetrain.runtime.backward import activation_checkpoint as checkpointing
from pipetrain.runtime.layers import split
from pipetrain.runtime.pipeline import Pipeline
from pipetrain.schedule.registry import FAMILIES, build_schedule, family

GIB = 2**30
SPLITS = {"deferred": True, "replay": False, "default": None}
GPU_SHAPE = dict(layers=8, hidden=2048, heads=16, seq=1024, vocab=8192, mb_size=4, microbatches=8)
CPU_SHAPE = dict(layers=4, hidden=32, heads=2, seq=16, vocab=64, mb_size=2, microbatches=4)
#: the CPU dry run's schedules: one per kind of placement and backward (B only, I/W, V)
CPU_SCHEDULES = "1f1b,zb-h1,zbv"


class Bench:
    """This process's part: devices, the control group, the weights, the batch, the clock."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.cuda = args.device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else None
        # a gloo group for decisions, results and the barrier rank 1 waits at: no GPU work
        wait = timedelta(seconds=max(600.0, args.budget_s + 300.0))
        self.control = dist.new_group(backend="gloo", timeout=wait)
        self.cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, num_layers=args.layers,
                             hidden=args.hidden, num_heads=args.heads)  # fmt: skip
        self.dtype = getattr(torch, args.dtype)
        self._masters: dict[int, torch.nn.Module] = {}
        g = torch.Generator().manual_seed(1234)
        shape = (args.microbatches * args.mb_size, args.seq)
        self.x = torch.randint(0, args.vocab, shape, generator=g).to(self.device or "cpu")
        self.y = torch.randint(0, args.vocab, shape, generator=g).to(self.device or "cpu")
        self.began = time.perf_counter()

    def layer(self, index: int) -> torch.nn.Module:
        """A fresh copy of layer ``index`` on the host (one master each, built once)."""
        if index not in self._masters:
            self._masters[index] = gpt_layer(self.cfg, index).to(self.dtype)
        return copy.deepcopy(self._masters[index])

    @property
    def num_layers(self) -> int:
        return self.args.layers + 2

    def block_names(self) -> list[str]:
        return [f"layers.{i}" for i in range(1, self.args.layers + 1)]

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def say(self, text: str) -> None:
        if self.rank == 0:
            print(f"[recompute_cost {self.elapsed():6.1f}s] {text}", flush=True)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def agree(self, value):
        """Rank 0's ``value`` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, value) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, value, group=self.control)
        return out

    def memory_reset(self) -> None:
        gc.collect()  # a pipeline in a reference cycle would hold its stages into the next row
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def memory_peak(self) -> float | None:
        return torch.cuda.max_memory_allocated() / GIB if self.cuda else None


def checked(bench: Bench, params: list[torch.Tensor], step: Callable[[], torch.Tensor]) -> dict:
    """The first step's loss and this rank's squared gradient sum; gradients then dropped."""
    loss = float(step())
    sums = [p.grad.float().square().sum() for p in params if p.grad is not None]
    grad_sq = float(torch.stack(sums).sum()) if sums else 0.0
    for p in params:
        p.grad = None
    return {"first_loss": loss, "grad_sq": grad_sq}


def clearing(step: Callable[[], object], params: list[torch.Tensor]) -> Callable[[], None]:
    """``step``, then every gradient dropped (a timed step starts from none, on both sides)."""

    def run() -> None:
        step()
        for p in params:
            p.grad = None

    return run


def timed(bench: Bench, step: Callable[[], object], collective: bool) -> list[float]:
    """Warm-up, then up to ``--steps`` timed steps (ms) until ``--row-timeout-s``; a pipeline
    (``collective``) meets at a barrier before each step and its ranks stop together."""
    args = bench.args
    for _ in range(args.warmup):
        step()
    start, times = time.perf_counter(), []
    for _ in range(args.steps):
        going = time.perf_counter() - start < args.row_timeout_s or not times
        if collective:
            going = bench.agree(going)  # also the barrier before the step
        if not going:
            break
        bench.sync()
        t = time.perf_counter()
        step()
        bench.sync()
        times.append((time.perf_counter() - t) * 1e3)
    return times


def profiled(bench: Bench, step: Callable[[], None], stem: str) -> None:
    """One more step under torch.profiler (``--profile``): rank 0 writes the operators with the
    most host time and the kernels with the most device time, and how busy its GPU was, to
    ``profile-<stem>.txt`` beside the JSON — where a step's time goes when it grows."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.cuda else [])
    bench.agree(True)
    bench.sync()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        step()
        bench.sync()
        wall_ms = (time.perf_counter() - t) * 1e3
    if bench.rank != 0:
        return
    kernels = [  # device events, less the action labels' ranges (user annotations)
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and not getattr(e, "is_user_annotation", False)
        and " mb " not in e.name
    ]
    compute_ms = sum(e.time_range.elapsed_us() for e in kernels if "nccl" not in e.name.lower())
    compute_ms /= 1e3
    events = prof.key_averages()
    text = [f"{stem}: step {wall_ms:.1f} ms under the profiler; rank 0's non-NCCL kernels "
            f"{compute_ms:.1f} ms ({compute_ms / wall_ms:.0%} of the step)", "",
            events.table(sort_by="self_cpu_time_total", row_limit=25)]  # fmt: skip
    if bench.cuda:
        text += ["", events.table(sort_by="self_device_time_total", row_limit=15)]
    (Path(bench.args.out) / f"profile-{stem}.txt").write_text("\n".join(text))


def unsplit_row(bench: Bench, mode: str) -> dict:
    """The whole model on this rank's device, recomputing as ``mode`` on the layers
    ``--wrap`` names, one step accumulating over the micro-batches; ``"whole"``: the model as
    one region (the module docstring), its extra forward the step's own."""
    bench.memory_reset()
    layers = [bench.layer(i).to(bench.device or "cpu") for i in range(bench.num_layers)]
    (stage,) = split(layers, [bench.num_layers])
    if bench.args.wrap == "all" and mode != "whole":
        (stage,) = checkpointing.recompute_stages([stage], [mode])
    elif mode not in ("none", "whole"):
        checkpointing.recompute_layers(stage, dict.fromkeys(bench.block_names(), mode))
    params = list(stage.parameters())
    n = bench.args.microbatches
    pieces = list(zip(bench.x.chunk(n), bench.y.chunk(n), strict=True))

    def step() -> torch.Tensor:
        total = torch.zeros((), device=bench.x.device)
        if mode == "whole":
            with torch.no_grad():
                for xs, ys in pieces:
                    lm_loss(stage(xs), ys)
        for xs, ys in pieces:
            loss = lm_loss(stage(xs), ys) / n
            loss.backward()
            total += loss.detach()
        return total

    first = checked(bench, params, step)
    if bench.args.cuda_graph and bench.cuda:
        times = timed(bench, graphed(step, params), collective=False)
    else:
        times = timed(bench, clearing(step, params), collective=False)
    return {"kind": "unsplit", "recompute": mode, "step_ms": statistics.median(times),
            "cuda_graph": bool(bench.args.cuda_graph and bench.cuda),
            "all_ms": [round(t, 3) for t in times], "peak_gib": [bench.memory_peak()],
            "first_loss": first["first_loss"], "grad_sq": [first["grad_sq"]]}  # fmt: skip


def graphed(step: Callable[[], torch.Tensor], params: list[torch.Tensor]) -> Callable[[], None]:
    """The unsplit step as one CUDA graph (``--cuda-graph 1``), so that both sides of a quotient
    replay: a graphed pipeline pays no per-operator host time (selective recompute's dispatch mode
    included), and an eager unsplit model would. The captured step zeroes the gradients in place
    (the warm-up steps before the capture make them) and accumulates into them, as an eager step
    into fresh ones."""
    from benchmarks.recompute.recompute_price_gpu import capture  # CUDA only

    def zeroed() -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)
        step()

    return capture(zeroed).replay


def make_pipeline(bench: Bench, name: str, defer: bool, mode: str) -> Pipeline:
    """``name`` on the GPT's layers, recomputing as ``mode`` the way a user asks for it."""
    args, world = bench.args, bench.world
    v = family(name).default_stages_per_rank
    num_stages = v * world
    counts = [b - a for a, b in stage_layers(args.layers, num_stages)]
    counts[0], counts[-1] = counts[0] + 1, counts[-1] + 1  # the embedding and the head
    options = dict(loss_fn=lm_loss, device=bench.device or "cpu",
                   timeout=timedelta(seconds=args.timeout_s), defer_weight_grads=defer,
                   cuda_graph=bool(args.cuda_graph))  # fmt: skip
    if mode == "whole":  # every stage recomputed as one region (not a plan's mode)
        lazy = split(bench.layer, counts, num_layers=bench.num_layers)  # built when asked for
        return Pipeline(lambda s: checkpointing.recompute_stage(lazy[s], "whole", s), name,
                        args.microbatches, stages_per_rank=v, num_stages=num_stages,
                        **options)  # fmt: skip
    if args.wrap == "all" or mode == "none":  # a plan's per-stage recompute
        layout = Layout(schedule=name, ranks=world, stages_per_rank=v,
                        microbatches=args.microbatches, stage_layers=tuple(counts),
                        recompute=(mode,) * num_stages)  # fmt: skip
        return Pipeline.from_plan(bench.layer, layout, **options)
    stages = split(bench.layer, counts, num_layers=bench.num_layers)
    blocks = set(bench.block_names())

    def stage(s: int) -> torch.nn.Module:
        wanted = {n: mode for n in stages[s].layer_names if n in blocks}
        return checkpointing.recompute_layers(stages[s], wanted, s)

    return Pipeline(stage, name, args.microbatches, stages_per_rank=v, num_stages=num_stages,
                    **options)  # fmt: skip


def pipeline_row(bench: Bench, name: str, split_name: str, mode: str) -> dict:
    """One (schedule, split, recompute) row, measured on every rank and gathered."""
    bench.memory_reset()
    mine: dict = {}
    pipe = None
    try:
        pipe = make_pipeline(bench, name, SPLITS[split_name], mode)
        params = list(pipe.parameters())
        step = functools.partial(pipe.step, bench.x, bench.y)
        mine = checked(bench, params, step)
        mine["times"] = timed(bench, clearing(step, params), collective=True)
        if f"{name}/{split_name}/{mode}" in bench.args.profile.split(","):
            profiled(bench, clearing(step, params), f"{name}-{split_name}-{mode}")
    except Exception as e:  # a failed row is recorded, the run goes on
        mine = {"error": f"{type(e).__name__}: {e}"[:2000]}
    finally:
        if pipe is not None:
            pipe.close()
    mine["peak_gib"] = bench.memory_peak()
    everyone = bench.gather(mine)
    row = {"kind": "pipeline", "schedule": name, "split": split_name, "recompute": mode,
           "defer_weight_grads": SPLITS[split_name],
           "peak_gib": [r["peak_gib"] for r in everyone]}  # fmt: skip
    errors = [f"rank {r}: {m['error']}" for r, m in enumerate(everyone) if "error" in m]
    if errors:
        return {**row, "error": "; ".join(errors)}
    slowest = [max(ts) for ts in zip(*(r["times"] for r in everyone), strict=False)]
    return {**row, "step_ms": statistics.median(slowest), "all_ms": [round(t, 3) for t in slowest],
            "step_ms_per_rank": [statistics.median(r["times"]) for r in everyone],
            "first_loss": everyone[0]["first_loss"],
            "grad_sq": [r["grad_sq"] for r in everyone]}  # fmt: skip


def schedules(args: argparse.Namespace, world: int) -> list[tuple[str, str | None]]:
    """(family, why it is skipped or None): the ones asked for, else every family the registry
    runs, each built once for this shape (a family that cannot run it says why)."""
    names = [str(n) for n, f in FAMILIES.items() if f.runnable]
    if args.schedules:
        names = [str(family(n).name) for n in args.schedules.split(",") if n]
    out = []
    for name in names:
        fam = family(name)
        why = None if fam.runnable else "the runtime does not run it"
        if why is None:
            try:
                build_schedule(name, world, args.microbatches, fam.default_stages_per_rank)
            except ValueError as e:
                why = str(e)
        out.append((name, why))
    return out


def run(args: argparse.Namespace, rank: int, world: int) -> int:
    bench = Bench(args, rank, world)
    cpu = not bench.cuda
    meta = {"device": torch.cuda.get_device_name() if bench.cuda else "cpu", "world": world,
            "torch": torch.__version__, "args": vars(args), "target_quotient": TARGET,
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}  # fmt: skip
    out = Path(args.out) / "recompute_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        problems, ratios = compare(rows, cpu)
        bench.say(line(row, ratios))
        if rank == 0:
            write(out, meta, rows, problems, ratios)

    bench.say(f"{meta['device']} x {world}; wrap {args.wrap}; {args.steps} timed steps after "
              f"{args.warmup} warm-up")  # fmt: skip
    unsplit = []
    if rank == 0:  # the unsplit model alone; rank 1 waits at the gloo barrier below
        unsplit = [unsplit_row(bench, mode) for mode in MODES if mode in args.modes]
    dist.barrier(group=bench.control)
    for row in bench.agree(unsplit):
        record(row)
    for name, why in schedules(args, world):
        for split_name in args.splits.split(","):
            for mode in args.modes:
                label = {"kind": "pipeline", "schedule": name, "split": split_name,
                         "recompute": mode}  # fmt: skip
                if why is not None:
                    record({**label, "skipped": why})
                elif not bench.agree(bench.elapsed() < args.budget_s):  # every rank skips
                    record({**label, "skipped": f"past --budget-s {args.budget_s}"})
                else:
                    record(pipeline_row(bench, name, split_name, mode))
    problems, ratios = compare(rows, cpu)
    for problem in problems:
        bench.say(f"MISMATCH {problem}")
    for text in summary(ratios):
        bench.say(text)
    if rank == 0:
        write(out, meta, rows, problems, ratios)
        bench.say(f"wrote {out}")
    dist.destroy_process_group()
    return 1 if problems and cpu else 0


def main(argv: list[str] | None = None) -> int:
    return launch(parse(argv), _start)


def _start(args: argparse.Namespace, rank: int, world: int) -> int:
    timeout = timedelta(seconds=max(600.0, args.budget_s + 300.0))
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world, timeout=timeout,
                                device_id=device)  # fmt: skip
    else:
        torch.set_num_threads(1)  # processes x threads would oversubscribe the cores
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return run(args, rank, world)


#: (flag, type, default, help) besides the shape's; a default of None is the device's
FLAGS = (
    ("--schedules", str, None, "comma list of families (default: every one the registry runs; "
     f"cpu: {CPU_SCHEDULES})"),
    ("--splits", str, "deferred,replay",
     "weight-gradient splits: deferred (defer_weight_grads=True), replay (False), default (None: "
     "what the pipeline picks); default deferred,replay"),
    ("--dtype", str, None, "bfloat16 or float32, parameters and activations (default bfloat16; "
     "cpu: float32)"),
    ("--warmup", int, 2, "untimed steps after the checked first (default 2)"),
    ("--cuda-graph", int, 0, "1: pipeline rows as Pipeline(cuda_graph=True), captured during the "
     "warm-up (needs --warmup >= 2), and the unsplit model's step as one CUDA graph (default 0)"),
    ("--modes", str, ",".join(MODES[:3]), "comma list of the rows' recompute: none, full, "
     "selective, whole (every stage recomputed as one region, recompute_stage's 'whole'; the "
     f"unsplit model as one region); default {','.join(MODES[:3])}"),
    ("--steps", int, 6, "timed steps per row (default 6)"),
    ("--budget-s", float, 500.0, "start no row after this many seconds (default 500)"),
    ("--row-timeout-s", float, 60.0, "stop a row's timed steps after this many s (default 60)"),
    ("--timeout-s", float, 120.0, "how long any wait on a peer may take, s (default 120)"),
    ("--profile", str, "", "comma list of schedule/split/recompute rows to trace one more step of "
     "(e.g. zbv/deferred/full): profile-<row>.txt beside the JSON"),
    ("--nproc", int, 2, "processes to spawn without torchrun (default 2)"),
    ("--out", str, os.environ.get("OUT", "out"), "folder for recompute_cost.json ($OUT)"),
)  # fmt: skip
SHAPE_FLAGS = {"layers": "blocks", "hidden": "hidden size", "heads": "attention heads",
               "seq": "sequence length", "vocab": "vocabulary", "mb_size": "sequences per "
               "micro-batch", "microbatches": "micro-batches per step"}  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--device", choices=("cuda", "cpu"), default="cuda",
        help="cuda: NCCL, a GPU per process; cpu: a dry run on gloo (tiny shape, float32)")  # fmt: skip
    add("--wrap", choices=("all", "blocks"), default="all",
        help="layers recompute wraps, on both sides: all (a plan's per-stage recompute) or the "
             "blocks only (default all)")  # fmt: skip
    for key, what in SHAPE_FLAGS.items():
        add(f"--{key.replace('_', '-')}", type=int, default=None,
            help=f"{what} (default {GPU_SHAPE[key]}; cpu: {CPU_SHAPE[key]})")  # fmt: skip
    for flag, kind, default, what in FLAGS:
        add(flag, type=kind, default=default, help=what)
    args = parser.parse_args(argv)
    cpu = args.device == "cpu"
    for key, value in (CPU_SHAPE if cpu else GPU_SHAPE).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    if args.dtype not in ("bfloat16", "float32"):
        parser.error(f"--dtype {args.dtype}: legal: bfloat16, float32")
    if args.schedules is None and cpu:
        args.schedules = CPU_SCHEDULES
    args.modes = args.modes.split(",")
    if "none" not in args.modes or any(m not in MODES for m in args.modes):
        parser.error(f"--modes {','.join(args.modes)}: legal: {', '.join(MODES)}, with none")
    bad = [s for s in args.splits.split(",") if s not in SPLITS]
    if bad:
        parser.error(f"--splits: unknown {bad[0]!r}; legal: {', '.join(SPLITS)}")
    return args


if __name__ == "__main__":
    sys.exit(main())
