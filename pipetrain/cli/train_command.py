"""``pipetrain train``: its flags as one table, and the ``TrainConfig`` built from them.

The table lists every flag in the order ``--help`` shows it; each flag is named as its
``TrainConfig`` field and takes that field's default, so the parser, the config and the command
line the launcher writes for its workers (``TrainConfig.argv``, parsed back here) name the same
things. The config checks itself when built (exit 2 on a bad value) and the application reads
only the config (``app.launch.run_train``). The application is imported when a parser is built
or the command runs, and torch only when it runs.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipetrain.cli.flags import (
    PROG,
    Command,
    Option,
    add_options,
    folder_options,
    microbatches_option,
    model_options,
    one_of,
    positive_float,
    positive_int,
    ranks_option,
    receive_lead,
    require_torch,
    schedule_options,
    stages_per_rank_option,
    with_defaults,
)
from pipetrain.cli.train_options import (
    checkpoint_options,
    data_options,
    eval_options,
    guard_options,
    moe_options,
    optimizer_options,
    resilience_options,
)
from pipetrain.schedule.registry import FAMILIES

if TYPE_CHECKING:
    from pipetrain.app.config import TrainConfig

HELP = (
    "train a model (tiny Llama by default) on a text file, pipeline x data parallel "
    "(launches the processes itself; under torchrun, each process is one of the job's)"
)


def options() -> tuple[Option, ...]:
    """The shape flags (default None: a plan gives them, else the defaults they name), the model
    flags, then the run's."""
    from pipetrain.app.config import (
        CHOICES,
        DEFAULT_MICROBATCHES,
        DEFAULT_RANKS,
        DEFAULT_SCHEDULE,
        TrainConfig,
    )

    runnable = [f.name for f in FAMILIES.values() if f.runnable]
    or_plan = ", or the plan's"
    shape = (
        *schedule_options(runnable, shown_default=DEFAULT_SCHEDULE + or_plan),
        ranks_option(
            help=f"pipeline ranks (default {DEFAULT_RANKS}{or_plan}); --ranks × --tp × --dp "
            "processes"
        ),
        stages_per_rank_option(runnable),
        microbatches_option(shown_default=f"{DEFAULT_MICROBATCHES}{or_plan}"),
        Option(
            ("--recompute",),
            metavar="MODE[,MODE...]",
            help="activation checkpointing, one mode for every stage or one per stage: none, "
            "selective, full, full:K / selective:K for a stage's first K layers, or whole (the "
            'stage recomputed as one region) (docs/planning.md, "Recompute")',
            shown_default="none" + or_plan,
        ),
    )
    run = (
        *_run_options(CHOICES),
        *optimizer_options(CHOICES),
        *moe_options(CHOICES),
        *data_options(CHOICES),
        *eval_options(),
        *_output_options(CHOICES),
        *checkpoint_options(),
        *guard_options(CHOICES),
        *resilience_options(),
        *_process_options(CHOICES),
    )
    folder = with_defaults(folder_options(), TrainConfig())
    config = Option(
        ("--config",),
        metavar="FILE.toml",
        help="read these flags from a TOML file, each by its name (seq_len = 2048, or "
        '"seq-len"); flags given on the command line override it',
    )
    return (config, *shape, *folder, *model_options(), *with_defaults(run, TrainConfig()))


def _run_options(choices: dict[str, tuple[str, ...]]) -> tuple[Option, ...]:
    """The flags of the run: data parallel, steps, clipping, plan."""
    return (
        Option(
            ("--dp",), type=positive_int, metavar="D", help="data-parallel replicas of the pipeline"
        ),
        one_of(
            "--data-parallel",
            choices["data_parallel"],
            "how the replicas hold the stages: DDP, or FSDP2 (fully_shard)",
        ),
        Option(
            ("--tp",),
            type=positive_int,
            metavar="T",
            help="tensor-parallel size: each stage's layers split over T processes (Llama "
            "family). Processes are numbered pp-major, then data-parallel replica, tp "
            "innermost, so on NCCL the T processes of a stage are consecutive GPUs of one "
            "machine",
        ),
        Option(
            ("--sequence-parallel",),
            switch=True,
            help="with --tp: also shard the norms' tokens; activations between stages travel "
            "at 1/T of the bytes",
        ),
        Option(("--steps",), type=positive_int, metavar="N", help="optimizer steps"),
        Option(
            ("--clip-grad-norm",),
            type=positive_float,
            metavar="MAX",
            help="clip gradients to this norm of the whole model (default: no clipping)",
        ),
        Option(
            ("--corpus-out",),
            metavar="FILE",
            help="where the generated corpus is written when --data is not given",
        ),
        Option(
            ("--plan",),
            metavar="FILE",
            help="run a plan (`pipetrain plan --json > FILE`): its schedule, ranks, stages per "
            "rank, micro-batches, cut, recompute and offload; give no shape flags with it",
        ),
    )


def _output_options(choices: dict[str, tuple[str, ...]]) -> tuple[Option, ...]:
    """The flags of what the run writes: checkpoints, and the measured step's pictures."""
    return (
        Option(
            ("--checkpoint-dir",),
            metavar="DIR",
            help="write checkpoints (model and optimizer, DCP) under DIR",
        ),
        Option(
            ("--checkpoint-every",),
            type=positive_int,
            metavar="K",
            help="write one every K steps (default: after the last step only)",
        ),
        Option(
            ("--resume",),
            switch=True,
            help="continue from the latest checkpoint in --checkpoint-dir (bit for bit on the "
            "same layout)",
        ),
        Option(
            ("--verify-checkpoint",),
            switch=True,
            help="with --resume, check every file of the checkpoint against its SHA256SUMS "
            "first and refuse a damaged one, naming the last good checkpoint (reads the "
            "checkpoint twice; `pipetrain verify DIR` checks without resuming)",
        ),
        Option(
            ("--overwrite-checkpoints",),
            switch=True,
            help="replace the checkpoints already in --checkpoint-dir (removed when this run "
            "writes its first); without it or --resume, a folder holding checkpoints is refused",
        ),
        one_of(
            "--on-nonfinite",
            choices["on_nonfinite"],
            "at a loss that is nan or inf: stop the run (exit 1, naming the step), or skip that "
            "step's optimizer update",
        ),
        Option(("--svg",), metavar="PATH", help="where to write the measured step as SVG"),
        Option(
            ("--trace",),
            metavar="PATH",
            help="also write the measured step as a Chrome/Perfetto trace JSON (on a GPU eager "
            "step with each rank's host issuing its actions on a track of its own)",
        ),
    )


def _process_options(choices: dict[str, tuple[str, ...]]) -> tuple[Option, ...]:
    """The flags of each process: its device, how it splits the backward and waits on peers."""
    return (
        one_of(
            "--device",
            choices["device"],
            "cuda needs a GPU per process (NCCL); cpu runs gloo; auto picks cuda when there are "
            "enough GPUs",
        ),
        one_of(
            "--weight-grads",
            choices["weight_grads"],
            "how I/W split the backward: deferred linear weight GEMMs (the zero-bubble paper's "
            "way), graph replay (any module), or auto (deferred on split-backward stages made "
            "mostly of linears)",
        ),
        Option(
            ("--receive-lead",),
            type=receive_lead,
            metavar="{none,0,1,...}",
            help="post each receive at most this many compute actions before the one that reads "
            "it (1: Megatron-Core's overlapped P2P; none: as soon as its value can have arrived)",
        ),
        Option(
            ("--cuda-graph",),
            switch=True,
            help="capture each training step as one CUDA graph and replay it (GPUs, no "
            "--dp/--tp; the report then has step times, not a measured timeline)",
        ),
        Option(
            ("--float8",),
            switch=True,
            help="torchao float8 training linears in every layer but the LM head (tensorwise "
            "scales; emulated on the CPU); no --dp/--tp",
        ),
        Option(
            ("--compile",),
            switch=True,
            help="torch.compile each layer (inductor); without --dp/--tp every rank compiles "
            "its stages at once before the first step instead of one rank after another",
        ),
        Option(
            ("--timeout",),
            type=positive_float,
            metavar="SECONDS",
            help="how long a rank waits on a peer before failing",
        ),
        # set by the own launcher on the processes it starts (torchrun's need none); users
        # never pass it
        Option(("--worker",), switch=True, help=argparse.SUPPRESS),
    )


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The ``TrainConfig`` the parsed flags describe (``ValueError`` for a value it refuses)."""
    from pipetrain.app.config import TrainConfig

    names = (f.name for f in dataclasses.fields(TrainConfig))
    return TrainConfig(**{name: getattr(args, name) for name in names})


def config_from_argv(argv: Sequence[str]) -> TrainConfig:
    """Parse ``train``'s flags (what a worker is started with; the demo's jobs) into a config."""
    return config_from(parse_train(list(argv)))


def parse_train(argv: Sequence[str]) -> argparse.Namespace:
    """``train``'s flags parsed, those of ``--config FILE`` (``cli.config_file``) under the ones
    given in ``argv`` (``ValueError`` for a file that cannot be read as flags)."""
    parser = argparse.ArgumentParser(prog=f"{PROG} train", allow_abbrev=False)
    table = options()
    add_options(parser, table)
    args = parser.parse_args(list(argv))
    if args.config is None:
        return args
    from pipetrain.cli.config_file import read_config

    parser.set_defaults(**read_config(args.config, table))
    return parser.parse_args(list(argv))


def reparse(args: argparse.Namespace, argv: Sequence[str]) -> argparse.Namespace:
    """With ``--config``: ``args`` again, the file's values under the command line's (``argv``:
    the command line after ``train``)."""
    if getattr(args, "config", None) is None:
        return args
    return argparse.Namespace(**vars(parse_train(argv)), command=args.command)


def run(args: argparse.Namespace) -> int:
    require_torch()
    from pipetrain.app.launch import run_train
    from pipetrain.app.torchrun import run_under_torchrun, under_torchrun

    config = config_from(args)
    return run_under_torchrun(config) if under_torchrun(config) else run_train(config)


COMMAND = Command(name="train", help=HELP, options=options, run=run, reparse=reparse)
