"""``pipetrain train``: train a small GPT with any schedule, then compare measured with simulated.

This is application code, not runtime: it uses the runtime (``Pipeline``), the simulator and the
renderers together. Run outside torchrun, ``run_train`` checks the arguments (exit 2 on bad input,
before any process starts) and launches P worker processes through torchrun — gloo on CPU, NCCL
when there is a GPU per rank — each running this same command. A worker builds its own stages of
the model (same seed everywhere, so the weights equal the unsplit model's), trains with AdamW, and
on rank 0 shows a progress bar. The last steps are measured (``timeline=True``); the report puts
the measured bubble next to the simulator's prediction from the measured per-stage F/I/W/B times,
draws the measured step in the terminal and writes it as SVG.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Any

from pipetrain.flags import (
    add_microbatches,
    add_ranks,
    add_schedule,
    add_stages_per_rank,
    describe_shape,
    positive_float,
    positive_int,
    shape_argv,
)
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.registry import FAMILIES, build_schedule, family
from pipetrain.schedule.timeline import Timeline
from pipetrain.sim.costs import mean_durations, measured_costs

if TYPE_CHECKING:
    import torch

MEASURED_STEPS = 5  # the last steps run with timeline=True; the median one is reported
LOSS_WINDOW = 5  # first/last steps averaged to say whether the loss went down


@dataclass(frozen=True)
class _Opt:
    flags: tuple[str, ...]
    type: Any
    default: Any
    metavar: str
    help: str

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")


#: the demo's shape: what ``pipetrain train`` runs without flags
DEFAULT_SCHEDULE, DEFAULT_RANKS, DEFAULT_MICROBATCHES = "zbv", 4, 8
_OPTIONS = (
    _Opt(("--microbatch-size",), positive_int, 4, "B", "sequences per micro-batch"),
    _Opt(("--steps",), positive_int, 150, "N", "optimizer steps"),
    _Opt(("--layers",), positive_int, 8, "L", "transformer blocks (>= total stages)"),
    _Opt(("--hidden",), positive_int, 64, "H", "hidden size (a multiple of --heads)"),
    _Opt(("--heads",), positive_int, 4, "N", "attention heads"),
    _Opt(("--seq-len",), positive_int, 64, "T", "tokens (bytes) per sequence"),
    _Opt(("--lr",), positive_float, 3e-3, "LR", "AdamW learning rate"),
    _Opt(("--seed",), int, 0, "S", "seed for the weights and the batches"),
    _Opt(
        ("--dtype",),
        str,
        "float32",
        "{float32,bfloat16,float64}",
        "parameter and activation dtype",
    ),
    _Opt(("--svg",), str, "out/train_step.svg", "PATH", "where to write the measured step as SVG"),
    _Opt(
        ("--device",),
        str,
        "auto",
        "{auto,cpu,cuda}",
        "cuda needs a GPU per rank (NCCL); cpu runs gloo; auto picks cuda when there are enough GPUs",
    ),
    _Opt(
        ("--weight-grads",),
        str,
        "auto",
        "{auto,deferred,replay}",
        "how I/W split the backward: deferred linear weight GEMMs (the zero-bubble paper's way), "
        "graph replay (any module), or auto (deferred on stages made mostly of linears)",
    ),
    _Opt(
        ("--timeout",),
        positive_float,
        300.0,
        "SECONDS",
        "how long a rank waits on a peer before failing",
    ),
)
_CHOICES = {
    "dtype": ("float32", "bfloat16", "float64"),
    "device": ("auto", "cpu", "cuda"),
    "weight_grads": ("auto", "deferred", "replay"),
}
#: ``--weight-grads`` → ``Pipeline(defer_weight_grads=...)``
_DEFER = {"auto": None, "deferred": True, "replay": False}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags (each with its unit and default in the help) to ``parser``."""
    runnable = [f.name for f in FAMILIES.values() if f.runnable]
    add_schedule(parser, runnable, default=DEFAULT_SCHEDULE)
    add_ranks(parser, default=DEFAULT_RANKS, help="pipeline ranks = processes launched")
    add_stages_per_rank(parser, runnable)
    add_microbatches(parser, default=DEFAULT_MICROBATCHES)
    for opt in _OPTIONS:
        default = f"{opt.default:g}" if isinstance(opt.default, float) else opt.default
        parser.add_argument(
            *opt.flags,
            dest=opt.dest,
            type=opt.type,
            default=opt.default,
            metavar=opt.metavar,
            choices=_CHOICES.get(opt.dest),
            help=f"{opt.help} (default {default})",
        )
    # set by the launcher on the processes it starts; users never pass it
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def _argv(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce ``args`` (what the launcher passes to every worker)."""
    out = shape_argv(args)
    for opt in _OPTIONS:
        value = getattr(args, opt.dest)
        if value is not None:
            out += [opt.flags[0], str(value)]
    return out


def check_arguments(args: argparse.Namespace) -> int:
    """Validate everything that needs no process; return the total stage count.

    Raises ``ValueError`` naming the bad value and the legal ones.
    """
    for opt in _OPTIONS:
        value = getattr(args, opt.dest)
        if opt.dest in _CHOICES and value not in _CHOICES[opt.dest]:
            raise ValueError(f"--{opt.dest} must be one of {', '.join(_CHOICES[opt.dest])}")
        if isinstance(value, int | float) and opt.dest != "seed" and value <= 0:
            raise ValueError(f"{opt.flags[0]} must be > 0, got {value}")
    if not family(args.schedule).runnable:  # unknown names: family() lists the legal ones
        runnable = ", ".join(f.name for f in FAMILIES.values() if f.runnable)
        raise ValueError(
            f"{args.schedule} is for planning only (two copies of the model); train with one of "
            f"{runnable}"
        )
    program = build_schedule(args.schedule, args.ranks, args.microbatches, args.stages_per_rank)
    if args.layers < program.num_stages:
        raise ValueError(
            f"--layers {args.layers} is fewer than the {program.num_stages} stages of {args.schedule} "
            f"on {args.ranks} ranks; every stage needs at least one block: use --layers >= "
            f"{program.num_stages}"
        )
    if args.hidden % args.heads:
        raise ValueError(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    return program.num_stages


def run_train(args: argparse.Namespace) -> int:
    """Launch the workers (outside torchrun) or be one (inside); return the exit status."""
    try:
        check_arguments(args)
    except ValueError as e:
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        return _worker(args)
    return _launch(args)


def _resolve_device(args: argparse.Namespace) -> str:
    import torch

    gpus = torch.cuda.device_count()
    if args.device == "cuda" and gpus < args.ranks:
        raise ValueError(f"--device cuda needs {args.ranks} GPUs (one per rank); found {gpus}")
    if args.device == "auto":
        return "cuda" if gpus >= args.ranks else "cpu"
    return str(args.device)


def _launch(args: argparse.Namespace) -> int:
    try:
        device = _resolve_device(args)
    except ValueError as e:
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    argv = _argv(argparse.Namespace(**{**vars(args), "device": device}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(args.ranks), "-m", "pipetrain", "train", *argv, "--worker"]
    # one thread per process (they share the cores); setting it also silences torchrun's warning
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    print(
        f"launching {args.ranks} processes ({'NCCL' if device == 'cuda' else 'gloo'} on {device})"
    )
    sys.stdout.flush()
    return subprocess.call(cmd, env=env)


def _worker(args: argparse.Namespace) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    device_kind = _resolve_device(args)
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        status = _train(args, rank, device)
        # Tear down together: a gloo group destroyed while a peer is still busy (rank 0 writing
        # the report) can abort the process at exit.
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()


def _train(args: argparse.Namespace, rank: int, device: torch.device) -> int:
    from datetime import timedelta

    import torch

    from pipetrain.app.models import GPTConfig, batches, corpus_tensor, lm_loss, make_stage
    from pipetrain.runtime.pipeline import Pipeline

    num_stages = check_arguments(args)
    cfg = GPTConfig(
        seq_len=args.seq_len, num_layers=args.layers, hidden=args.hidden, num_heads=args.heads
    )
    dtype = getattr(torch, args.dtype)
    pipe = Pipeline(
        lambda s: make_stage(cfg, s, num_stages, seed=args.seed).to(dtype),
        num_stages=num_stages,
        schedule=args.schedule,
        num_microbatches=args.microbatches,
        loss_fn=lm_loss,
        stages_per_rank=args.stages_per_rank,
        device=device,
        timeout=timedelta(seconds=args.timeout),
        defer_weight_grads=_DEFER[args.weight_grads],
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95))
    data = batches(
        corpus_tensor(), args.microbatch_size * args.microbatches, args.seq_len, args.seed
    )
    bar = _Progress(args.steps, enabled=rank == 0)
    losses: list[float] = []
    measured: list[Timeline] = []
    for step in range(args.steps):
        inputs, targets = (t.to(device) for t in next(data))
        timed = step >= args.steps - MEASURED_STEPS
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(inputs, targets, timeline=timed)
        opt.step()
        losses.append(float(loss))
        bar.update(step + 1, losses[-1], inputs.numel() / (time.perf_counter() - t0))
        if timed and pipe.last_timeline is not None:
            measured.append(pipe.last_timeline)
    bar.close()
    if rank == 0:
        print(report(args, losses, measured, pipe.program, shared_cores=device.type == "cpu"))
    return 0


class _Progress:
    """One updating line on a TTY; otherwise a line every tenth of the run."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stdout.isatty()
        self.every = max(1, total // 10)
        self.rates: list[float] = []

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        self.rates = [*self.rates[-9:], tokens_per_s]  # smooth over the last 10 steps
        rate = fmean(self.rates) if step > 1 else tokens_per_s  # step 1 includes warm-up
        done = int(30 * step / self.total)
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (30 - done)}] "
            f"loss {loss:.4f}  {rate:,.0f} tok/s"
        )
        if self.tty:
            print(f"\r{line}\x1b[K", end="", flush=True)  # \x1b[K: clear the rest of the line
        elif step % self.every == 0 or step in (1, self.total):
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            print(flush=True)


def _costs_table(timelines: Sequence[Timeline], num_stages: int) -> str:
    """Mean measured ms per (stage, kind); kinds the schedule never ran are left out."""
    mean = mean_durations(timelines)
    kinds = [k for k in OpKind if any((k, s) in mean for s in range(num_stages))]
    names = {OpKind.OVERLAP_F_B: "F&B"}
    head = "".join(f"{names.get(k, k.value):>8}" for k in kinds)
    lines = [f"mean time per action in that step (ms)\n  stage{head}"]
    for s in range(num_stages):
        cells = (mean.get((k, s)) for k in kinds)
        lines.append(f"  {s:>5}" + "".join("       -" if c is None else f"{c:8.2f}" for c in cells))
    return "\n".join(lines)


def report(
    args: argparse.Namespace,
    losses: Sequence[float],
    measured: Sequence[Timeline],
    program: Any,
    shared_cores: bool = False,
) -> str:
    """The end-of-run text: loss trend, measured vs simulated bubble, pictures (writes the SVG).

    ``shared_cores``: the ranks ran as processes on this machine's CPU cores (notes when there
    were more processes than cores, as the measured times then include waiting for a core).
    """
    k = max(1, min(LOSS_WINDOW, len(losses) // 4))
    first, last = fmean(losses[:k]), fmean(losses[-k:])
    verdict = (
        f"the loss went DOWN by {100 * (first - last) / first:.0f}%"
        if last < first
        else "the loss did NOT go down"
    )
    title = describe_shape(
        args.schedule,
        program.num_ranks,
        program.placement.stages_per_rank,
        program.num_microbatches,
    )
    lines = [f"loss {first:.4f} → {last:.4f} (mean of the first vs last {k} steps): {verdict}"]
    if not measured:
        return "\n".join([*lines, "(no measured timeline: the runtime returned none)"])
    from pipetrain.sim.simulate import simulate

    step = sorted(measured, key=lambda tl: tl.makespan)[len(measured) // 2]
    costs = measured_costs([step], program.num_stages)
    predicted = simulate(program, costs)
    lines += [
        f"measured step:   makespan {step.makespan:8.2f} ms   bubble {step.bubble_fraction:6.1%}"
        f"   (the median of the last {len(measured)} steps)",
        _costs_table([step], program.num_stages),
        f"simulated step:  makespan {predicted.makespan:8.2f} ms   bubble "
        f"{predicted.bubble_fraction:6.1%}   (from the measured times above, communication "
        "taken as free)",
    ]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if shared_cores and cores and program.num_ranks > cores:
        lines.append(
            f"note: {program.num_ranks} processes share {cores} CPU cores, so measured times "
            "include waiting for a core"
        )
    lines += _pictures(args, step, title)
    return "\n".join(lines)


def _pictures(args: argparse.Namespace, step: Timeline, title: str) -> list[str]:
    from pipetrain.render.svg import render_svg
    from pipetrain.render.text import render_text

    path = Path(args.svg)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_svg(step, title=f"{title} — measured (ms)"))
    width = shutil.get_terminal_size().columns
    return ["", f"{title} — measured step (ms)", render_text(step, width), f"wrote {path}"]


__all__ = ["add_train_arguments", "check_arguments", "report", "run_train"]
