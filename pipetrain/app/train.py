"""``pipetrain train``: train a model cut into pipeline stages on a text file, then compare the
measured step with the simulator's.

One command for every model ``app.catalog`` builds — the built-in GPT and the Hugging
Face Llama family (``--model llama|qwen3|mistral``, from a ``transformers`` config: tiny by
default, nothing downloaded) — as a list of layers cut into stages by per-stage layer counts:
the default cut (blocks spread evenly, embedding and head on the end stages) or a plan's
(``--plan FILE`` from ``pipetrain plan --json``, run with ``Pipeline.from_plan``). Tokens are the
bytes of a text file (``--text``; by default the corpus ``app.models.data`` generates, written to
``--corpus-out`` first).

This is application code, not runtime: it uses the runtime (``Pipeline``), the simulator and the
renderers together. Run outside a launcher, ``run_train`` checks the arguments (exit 2 on bad
input, before any process starts) and launches ``--ranks`` × ``--dp`` worker processes through
torchrun — gloo on CPU, NCCL with a GPU per process — each running this same command. A worker
builds its own stages (same seed everywhere, so the weights equal the unsplit model's), trains
with AdamW (``--clip-grad-norm``: clipped by the whole pipeline's norm), writes checkpoints every
``--checkpoint-every`` steps (``app.checkpoints``; ``--resume`` continues from the latest one
bit for bit), and on rank 0 shows a progress bar (loss, tokens/s). The last steps are measured
(``timeline=True``); the report puts the measured bubble next to the simulator's prediction from
the measured per-stage F/I/W/B times, draws the measured step in the terminal and writes it as SVG.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import TYPE_CHECKING, Any

from pipetrain.app.catalog import BYTE_VOCAB, MODELS, ModelShape, default_stage_layers
from pipetrain.flags import (
    add_microbatches,
    add_ranks,
    add_schedule,
    add_stages_per_rank,
    describe_shape,
    positive_float,
    positive_int,
    shape_argv,
    shape_flags_given,
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
    type: Any  # bool: a flag without a value
    default: Any
    metavar: str
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")


#: the shape ``pipetrain train`` runs without flags or a plan
DEFAULT_SCHEDULE, DEFAULT_RANKS, DEFAULT_MICROBATCHES = "1f1b", 2, 4
#: flags that define the model (``pipetrain profile`` takes them too)
MODEL_OPTIONS = (
    _Opt(("--model",), str, "llama", "{" + ",".join(MODELS) + "}", "model", MODELS),
    _Opt(("--layers",), positive_int, 4, "L", "transformer blocks"),
    _Opt(("--hidden",), positive_int, 64, "H", "hidden size (a multiple of --heads)"),
    _Opt(("--heads",), positive_int, 4, "N", "attention heads"),
    _Opt(("--kv-heads",), positive_int, 2, "N", "key/value heads (Hugging Face models)"),
    _Opt(("--vocab",), positive_int, 256, "V", "vocabulary size (tokens are bytes: >= 256)"),
    _Opt(("--seq-len",), positive_int, 64, "T", "tokens (bytes) per sequence"),
    _Opt(
        ("--tie-embeddings",),
        bool,
        False,
        "",
        "tie the LM head to the token embedding (Hugging Face models; not yet with --dp > 1)",
    ),
    _Opt(
        ("--dtype",),
        str,
        "float32",
        "{float32,bfloat16,float64}",
        "parameter and activation dtype",
        ("float32", "bfloat16", "float64"),
    ),
    _Opt(("--seed",), int, 0, "S", "seed for the weights and the batches"),
    _Opt(
        ("--microbatch-size", "--micro-batch-size"),
        positive_int,
        4,
        "B",
        "sequences per micro-batch",
    ),
)
_OPTIONS = (
    *MODEL_OPTIONS,
    _Opt(("--dp",), positive_int, 1, "D", "data-parallel replicas of the pipeline"),
    _Opt(
        ("--data-parallel",),
        str,
        "fsdp",
        "{ddp,fsdp}",
        "how the replicas hold the stages: DDP, or FSDP2 (fully_shard)",
        ("ddp", "fsdp"),
    ),
    _Opt(("--steps",), positive_int, 60, "N", "optimizer steps"),
    _Opt(("--lr",), positive_float, 3e-3, "LR", "AdamW learning rate"),
    _Opt(
        ("--clip-grad-norm",),
        positive_float,
        None,
        "MAX",
        "clip gradients to this norm of the whole model (default: no clipping)",
    ),
    _Opt(
        ("--text",),
        str,
        None,
        "FILE",
        "a text file to train on, its bytes the tokens (default: the generated corpus)",
    ),
    _Opt(
        ("--corpus-out",),
        str,
        "out/corpus.txt",
        "FILE",
        "where the generated corpus is written when --text is not given",
    ),
    _Opt(
        ("--plan",),
        str,
        None,
        "FILE",
        "run a plan (`pipetrain plan --json > FILE`): its schedule, ranks, stages per rank, "
        "micro-batches and cut; give no shape flags with it",
    ),
    _Opt(
        ("--checkpoint-dir",),
        str,
        None,
        "DIR",
        "write checkpoints (model and optimizer, DCP) under DIR",
    ),
    _Opt(
        ("--checkpoint-every",),
        positive_int,
        None,
        "K",
        "write one every K steps (default: after the last step only)",
    ),
    _Opt(
        ("--resume",),
        bool,
        False,
        "",
        "continue from the latest checkpoint in --checkpoint-dir (bit-identical continuation)",
    ),
    _Opt(("--svg",), str, "out/train_step.svg", "PATH", "where to write the measured step as SVG"),
    _Opt(
        ("--device",),
        str,
        "auto",
        "{auto,cpu,cuda}",
        "cuda needs a GPU per process (NCCL); cpu runs gloo; auto picks cuda when there are "
        "enough GPUs",
        ("auto", "cpu", "cuda"),
    ),
    _Opt(
        ("--weight-grads",),
        str,
        "auto",
        "{auto,deferred,replay}",
        "how I/W split the backward: deferred linear weight GEMMs (the zero-bubble paper's way), "
        "graph replay (any module), or auto (deferred on stages made mostly of linears)",
        ("auto", "deferred", "replay"),
    ),
    _Opt(
        ("--timeout",),
        positive_float,
        300.0,
        "SECONDS",
        "how long a rank waits on a peer before failing",
    ),
)
#: ``--weight-grads`` → ``Pipeline(defer_weight_grads=...)``
_DEFER = {"auto": None, "deferred": True, "replay": False}


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``train`` flags (each with its unit and default in the help) to ``parser``."""
    runnable = [f.name for f in FAMILIES.values() if f.runnable]
    # shape flags default to None: a plan gives them, else the defaults above
    or_plan = ", or the plan's"
    add_schedule(parser, runnable, shown_default=DEFAULT_SCHEDULE + or_plan)
    add_ranks(
        parser,
        help=f"pipeline ranks (default {DEFAULT_RANKS}{or_plan}); --ranks × --dp processes",
    )
    add_stages_per_rank(parser, runnable)
    add_microbatches(parser, shown_default=f"{DEFAULT_MICROBATCHES}{or_plan}")
    add_options(parser, _OPTIONS)
    # set by the launcher on the processes it starts; users never pass it
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def add_options(parser: argparse.ArgumentParser, options: Sequence[_Opt]) -> None:
    """Each option with its unit and default in the help."""
    for opt in options:
        if opt.type is bool:
            parser.add_argument(*opt.flags, dest=opt.dest, action="store_true", help=opt.help)
            continue
        default = f"{opt.default:g}" if isinstance(opt.default, float) else opt.default
        shown = f" (default {default})" if default is not None else ""
        parser.add_argument(
            *opt.flags,
            dest=opt.dest,
            type=opt.type,
            default=opt.default,
            metavar=opt.metavar,
            choices=opt.choices,
            help=opt.help + shown,
        )


def _argv(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce ``args`` (what the launcher passes to every worker)."""
    out = shape_argv(args)
    for opt in _OPTIONS:
        value = getattr(args, opt.dest)
        if opt.type is bool:
            out += [opt.flags[0]] if value else []
        elif value is not None:
            out += [opt.flags[0], str(value)]
    return out


@dataclass(frozen=True)
class Layout:
    """The run's pipeline: a plan (from ``--plan FILE``, or the flags and the default cut)."""

    schedule: str
    ranks: int
    stages_per_rank: int
    microbatches: int
    stage_layers: tuple[int, ...]
    from_file: str | None = None

    def plan(self) -> dict[str, object]:
        """As ``Pipeline.from_plan`` takes it."""
        return {
            "schedule": self.schedule,
            "ranks": self.ranks,
            "stages_per_rank": self.stages_per_rank,
            "microbatches": self.microbatches,
            "stage_layers": list(self.stage_layers),
        }


def model_shape(args: argparse.Namespace) -> ModelShape:
    return ModelShape(
        model=args.model,
        blocks=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        seq_len=args.seq_len,
        dtype=args.dtype,
        seed=args.seed,
        tie_embeddings=args.tie_embeddings,
    )


def check_arguments(args: argparse.Namespace) -> Layout:
    """Validate everything that needs no process; return the pipeline layout.

    Raises ``ValueError`` naming the bad value and the legal ones.
    """
    for opt in _OPTIONS:
        value = getattr(args, opt.dest)
        if opt.choices and value not in opt.choices:
            raise ValueError(f"{opt.flags[0]} must be one of {', '.join(opt.choices)}")
        if type(value) in (int, float) and opt.dest != "seed" and value <= 0:
            raise ValueError(f"{opt.flags[0]} must be > 0, got {value}")
    shape = model_shape(args)
    shape.check()
    if args.model != "gpt" and importlib.util.find_spec("transformers") is None:
        raise ValueError(
            f"--model {args.model} needs transformers: pip install 'pipetrain[hf]' (or train "
            "the built-in model: --model gpt)"
        )
    if args.vocab < BYTE_VOCAB:
        raise ValueError(f"--vocab {args.vocab}: the tokens are bytes, so it must be >= 256")
    if args.text is not None and not Path(args.text).is_file():
        raise ValueError(f"--text {args.text}: no such file")
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
    if args.resume:  # the checkpoint is there and of this model (a file read, no process)
        from pipetrain.app.checkpoints import Checkpoints

        Checkpoints(args.checkpoint_dir, shape).latest()
    layout = _layout(args, shape)
    if shape.num_layers < len(layout.stage_layers):
        raise ValueError(
            f"--layers {args.layers} gives {shape.num_layers} layers (with the embedding and "
            f"head) for {len(layout.stage_layers)} stages; every stage needs a layer: use "
            f"--layers >= {args.layers + len(layout.stage_layers) - shape.num_layers}"
        )
    if sum(layout.stage_layers) != shape.num_layers:
        raise ValueError(
            f"the plan in {layout.from_file} cuts {sum(layout.stage_layers)} layers "
            f"{list(layout.stage_layers)}, but --model {args.model} --layers {args.layers} has "
            f"{shape.num_layers}; plan from a profile of the same model (`pipetrain profile "
            f"--model {args.model} --layers {args.layers}`)"
        )
    return layout


def _layout(args: argparse.Namespace, shape: ModelShape) -> Layout:
    if not family(args.schedule or DEFAULT_SCHEDULE).runnable:  # family() names unknown ones
        runnable = ", ".join(f.name for f in FAMILIES.values() if f.runnable)
        raise ValueError(
            f"{args.schedule} is for planning only (two copies of the model); train with one of "
            f"{runnable}"
        )
    if args.plan is not None:
        given = shape_flags_given(args)
        if given:
            raise ValueError(
                f"--plan {args.plan} gives the schedule and its shape; drop {', '.join(given)}"
            )
        return _read_plan(args.plan)
    program = build_schedule(
        args.schedule or DEFAULT_SCHEDULE,
        args.ranks or DEFAULT_RANKS,
        args.microbatches or DEFAULT_MICROBATCHES,
        args.stages_per_rank,
    )
    if program.num_stages > shape.num_layers:
        counts = [1] * program.num_stages  # refused by the caller with the layer count
    else:
        counts = default_stage_layers(shape.model, shape.blocks, program.num_stages)
    return Layout(
        program.name,
        program.num_ranks,
        program.num_stages // program.num_ranks,
        program.num_microbatches,
        tuple(counts),
    )


def _read_plan(path: str) -> Layout:
    from pipetrain.runtime.pipeline import Pipeline

    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--plan {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--plan {path} is not JSON ({e}); write it with `pipetrain plan --json`"
        ) from None
    try:
        fields = Pipeline.plan_layout(raw)
    except ValueError as e:
        raise ValueError(f"--plan {path}: {e}") from None
    program = build_schedule(
        fields["schedule"], fields["ranks"], fields["microbatches"], fields["stages_per_rank"]
    )
    if not family(program.name).runnable or program.placement.num_chains > 1:
        raise ValueError(f"--plan {path}: {program.name} holds two copies of the model")
    return Layout(
        program.name,
        program.num_ranks,
        fields["stages_per_rank"],
        program.num_microbatches,
        fields["stage_layers"],
        from_file=path,
    )


def run_train(args: argparse.Namespace) -> int:
    """Launch the workers (outside torchrun) or be one (inside); return the exit status."""
    try:
        layout = check_arguments(args)
    except ValueError as e:
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        return _worker(args, layout)
    return _launch(args, layout)


def _resolve_device(args: argparse.Namespace, layout: Layout) -> str:
    import torch

    need, gpus = layout.ranks * args.dp, torch.cuda.device_count()
    if args.device == "cuda" and gpus < need:
        raise ValueError(f"--device cuda needs {need} GPUs (one per process); found {gpus}")
    if args.device == "auto":
        return "cuda" if gpus >= need else "cpu"
    return str(args.device)


def _launch(args: argparse.Namespace, layout: Layout) -> int:
    try:
        device = _resolve_device(args, layout)
    except ValueError as e:
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    processes = layout.ranks * args.dp
    argv = _argv(argparse.Namespace(**{**vars(args), "device": device}))
    backend = "NCCL" if device == "cuda" else "gloo"
    print(
        f"launching {processes} processes: {layout.ranks} pipeline × {args.dp} data parallel "
        f"({backend} on {device}); {args.model}, {_describe(layout)}"
    )
    sys.stdout.flush()
    status = start_processes(processes, [sys.executable, "-m", "pipetrain", "train", *argv])
    return 2 if status == _REFUSED else status


def start_processes(count: int, cmd: list[str]) -> int:
    """Run ``cmd --worker`` as ``count`` processes of one local process group (the environment
    torchrun sets: rank, world size, a free port); the first failure stops the others. Returns
    0, or the first failed process's status."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # one thread per process: they share the cores
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    base |= {"MASTER_PORT": str(port), "WORLD_SIZE": str(count)}
    base |= {"LOCAL_WORLD_SIZE": str(count)}
    procs = [
        subprocess.Popen([*cmd, "--worker"], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(count)
    ]
    status = 0
    try:
        while procs:
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code and not status:
                    status = code
                    for other in procs:  # peers would wait for it until their timeout
                        other.terminate()
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
    return status


def _describe(layout: Layout) -> str:
    cut = f"stage_layers {list(layout.stage_layers)}"
    source = f" (plan {layout.from_file})" if layout.from_file else ""
    return (
        describe_shape(layout.schedule, layout.ranks, layout.stages_per_rank, layout.microbatches)
        + f", {cut}{source}"
    )


#: a worker's exit status when the library refused the configuration (the launcher exits 2)
_REFUSED = 3


def _worker(args: argparse.Namespace, layout: Layout) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_kind = _resolve_device(args, layout)
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        try:
            run = train(args, device)
        except Refused as e:
            if dist.get_rank() == 0:
                print(f"pipetrain train: error: {e}", file=sys.stderr)
            return _REFUSED
        if dist.get_rank() == 0:
            print(run.report)
        # Tear down together: a gloo group destroyed while a peer is still busy (rank 0 writing
        # the report) can abort the process at exit.
        dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


class Refused(ValueError):
    """The pipeline refused the configuration at construction (the same on every rank)."""


@dataclass
class Run:
    """What a worker's training loop gives back."""

    losses: list[float]
    #: the step each loss belongs to (from the first step run, after a resume)
    first_step: int
    state: dict[str, Any] = field(default_factory=dict)
    report: str = ""


def read_tokens(args: argparse.Namespace) -> torch.Tensor:
    """The text file's bytes as token ids (the generated corpus, written first, by default)."""
    import torch

    path = Path(args.text) if args.text is not None else Path(args.corpus_out)
    if args.text is None and not path.is_file():
        from pipetrain.app.models.data import make_corpus

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several ranks may write at once
        tmp.write_bytes(make_corpus())
        tmp.replace(path)
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def train(args: argparse.Namespace, device: torch.device) -> Run:
    """One worker's training loop, inside an initialised process group of ranks × dp."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pipetrain.app import checkpoints
    from pipetrain.app.catalog import build
    from pipetrain.app.models.data import batches
    from pipetrain.runtime.pipeline import Pipeline

    layout = check_arguments(args)
    rank = dist.get_rank()
    model = build(model_shape(args))
    placement: dict[str, Any] = {}
    replica = 0
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.dp, layout.ranks), mesh_dim_names=("dp", "pp"))
        placement = {"mesh": mesh, "data_parallel": args.data_parallel}
        replica = mesh.get_local_rank("dp")
    try:
        pipe = Pipeline.from_plan(
            model.layers,
            layout.plan(),
            loss_fn=model.loss_fn,
            device=device,
            timeout=timedelta(seconds=args.timeout),
            defer_weight_grads=_DEFER[args.weight_grads],
            tied=model.tied,
            **placement,
        )
    except ValueError as e:
        flags = f"--tie-embeddings with --dp {args.dp}: " if model.tied and args.dp > 1 else ""
        raise Refused(flags + str(e)) from None
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95))
    saver = (
        checkpoints.Checkpoints(args.checkpoint_dir, model.shape) if args.checkpoint_dir else None
    )
    try:
        start = saver.resume(pipe, opt) if saver is not None and args.resume else 0
    except ValueError as e:
        raise Refused(str(e)) from None
    if start >= args.steps:
        raise Refused(
            f"the checkpoint in {args.checkpoint_dir} is at step {start}; --steps {args.steps} "
            "leaves nothing to run (give more steps)"
        )
    local = args.microbatch_size * layout.microbatches
    data = batches(read_tokens(args), local * args.dp, args.seq_len, args.seed)
    for _ in range(start):  # the batches the checkpointed steps used
        next(data)
    mine = slice(replica * local, (replica + 1) * local)
    every = args.checkpoint_every or args.steps
    bar = _Progress(args.steps, enabled=rank == 0, start=start)
    losses: list[float] = []
    measured: list[Timeline] = []
    for step in range(start, args.steps):
        inputs, targets = (t[mine].to(device) for t in next(data))
        timed = step >= args.steps - MEASURED_STEPS
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(*model.batch(inputs, targets), timeline=timed)
        norm = pipe.clip_grad_norm_(args.clip_grad_norm) if args.clip_grad_norm else None
        opt.step()
        losses.append(float(loss))
        rate = inputs.numel() * args.dp / (time.perf_counter() - t0)
        bar.update(step + 1, losses[-1], rate, None if norm is None else float(norm))
        if timed and pipe.last_timeline is not None:
            measured.append(pipe.last_timeline)
        if saver is not None and ((step + 1) % every == 0 or step + 1 == args.steps):
            saver.save(step + 1, pipe, opt)
    bar.close()
    run = Run(losses, start, {k: v.detach().clone() for k, v in _local_state(pipe).items()})
    if rank == 0:
        run.report = report(args, losses, measured, pipe.program, shared_cores=device.type == "cpu")
        if saver is not None:
            run.report += f"\ncheckpoints in {args.checkpoint_dir} (latest: step {args.steps})"
    return run


def _local_state(pipe) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by global name."""
    out = {}
    for s in sorted(pipe.modules):
        out.update(pipe.modules[s].state_dict())
    return out


class _Progress:
    """One updating line on a TTY; otherwise a line every tenth of the run."""

    def __init__(self, total: int, enabled: bool, start: int = 0) -> None:
        self.total, self.enabled, self.start = total, enabled, start
        self.tty = enabled and sys.stdout.isatty()
        self.every = max(1, total // 10)
        self.rates: list[float] = []

    def update(
        self, step: int, loss: float, tokens_per_s: float, grad_norm: float | None = None
    ) -> None:
        if not self.enabled:
            return
        self.rates = [*self.rates[-9:], tokens_per_s]  # smooth over the last 10 steps
        rate = fmean(self.rates) if step > self.start + 1 else tokens_per_s
        done = int(30 * step / self.total)
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{'#' * done}{'.' * (30 - done)}] "
            f"loss {loss:.4f}  {rate:,.0f} tok/s"
        )
        if grad_norm is not None:
            line += f"  grad norm {grad_norm:.3f}"
        if self.tty:
            print(f"\r{line}\x1b[K", end="", flush=True)  # \x1b[K: clear the rest of the line
        elif step % self.every == 0 or step in (self.start + 1, self.total):
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
        program.name,
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
