"""``pipetrain train``'s flags: one table of options (flag, type, default, unit, help) from which
the parser is built, the arguments are checked (``app.layout``) and the launcher writes the
command line every worker parses back (``argv``).

One table, so that a flag's help, default, check and way to the workers cannot drift apart.
``MODEL_OPTIONS`` are the flags that define the model; ``pipetrain profile`` takes them too
(``add_options``, ``model_shape``), so a costs file and a training run describe the same model.

No torch here: ``pipetrain --help`` builds its parser from this module and stays fast.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipetrain.app.catalog import MODELS, ModelShape
from pipetrain.flags import (
    add_microbatches,
    add_ranks,
    add_schedule,
    add_stages_per_rank,
    positive_float,
    positive_int,
    shape_argv,
)
from pipetrain.schedule.registry import FAMILIES


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


def receive_lead(text: str) -> int | None:
    """``none`` or an integer >= 0 (``--receive-lead``)."""
    if text == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected none or an integer >= 0, got {text!r}")
    return value


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
        "tie the LM head to the token embedding (Hugging Face models; FSDP2 + ties refused on NCCL)",
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
#: every ``train`` flag but the shape flags (``pipetrain.flags``), the model's first
OPTIONS = (
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
        "continue from the latest checkpoint in --checkpoint-dir (bit for bit on the same layout)",
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
        ("--receive-lead",),
        receive_lead,
        1,
        "{none,0,1,...}",
        "post each receive at most this many compute actions before the one that reads it "
        "(1: Megatron-Core's overlapped P2P; none: as soon as its value can have arrived)",
    ),
    _Opt(
        ("--timeout",),
        positive_float,
        300.0,
        "SECONDS",
        "how long a rank waits on a peer before failing",
    ),
)


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
    add_options(parser, OPTIONS)
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


def argv(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce ``args`` (what the launcher passes to every worker)."""
    out = shape_argv(args)
    for opt in OPTIONS:
        value = getattr(args, opt.dest)
        if opt.type is bool:
            out += [opt.flags[0]] if value else []
        elif value is not None:
            out += [opt.flags[0], str(value)]
    return out


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


__all__ = [
    "DEFAULT_MICROBATCHES",
    "DEFAULT_RANKS",
    "DEFAULT_SCHEDULE",
    "MODEL_OPTIONS",
    "OPTIONS",
    "add_options",
    "add_train_arguments",
    "argv",
    "model_shape",
]
