"""The command line's vocabulary: every flag, every validator, and the records that turn a table of
flags into a parser.

A command states its flags as a table, a tuple of ``Option`` records (spelling, validator,
default, unit, help), and ``add_options`` builds its parser from it, so a flag's help, default and
check cannot drift apart. A pipeline's shape is named the same way in every command — schedule,
ranks, micro-batches, stages per rank, micro-batch group size — so those flags are made here once
(``schedule_options``, ``ranks_option``, …) and each command takes the ones it needs; so are the
cost flags of ``simulate`` and ``compare`` and the model flags of ``profile`` and ``train``. The
costs file and memory budget of ``plan`` and ``synthesize`` are ``budget_flags``'.

Validators raise ``argparse.ArgumentTypeError``, which argparse reports as a one-line usage error
(exit 2, no traceback); a command's own input errors are ``UsageError``s, reported the same way.
Only the standard library and the schedule registry are imported at the top, so ``--help`` stays
fast and planning commands need no torch; the model flags read the application's names and
defaults when a parser is built.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Any

from pipetrain.schedule.registry import FAMILIES, family
from pipetrain.sim.costs import MAX_COST, Costs

if TYPE_CHECKING:
    from pipetrain.app.catalog import ModelShape

PROG = "pipetrain"
#: what to install when a command needs torch (planning-only installs stay light without it)
TORCH_HINT = "pip install 'pipetrain[torch]' (or torch==2.13.0 first, as `make demo` does)"


class UsageError(ValueError):
    """Bad command-line input; reported without a traceback, exit status 2."""


def require_torch(instead: str = "") -> None:
    """Refuse a command that needs torch with one line saying what to install (and ``instead``)."""
    try:
        import torch  # noqa: F401
    except ImportError as e:
        raise UsageError(f"needs PyTorch ({e}); install it: {TORCH_HINT}{instead}") from None


@dataclass(frozen=True)
class Option:
    """One row of a command's flag table: how a flag is spelled, checked and explained.

    The help ends with the default (``(default 4)``) unless ``shown_default`` says otherwise: a
    text to name instead, or ``""`` to name none (when the help says it in its own words).
    """

    flags: tuple[str, ...]
    _: KW_ONLY
    help: str
    type: Callable[[str], Any] | None = None
    default: Any = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    required: bool = False
    #: a flag without a value (``--json``)
    switch: bool = False
    shown_default: str | None = None
    #: the help section it is listed under (None: the command's options)
    group: str | None = None
    #: for the positional schedule: argparse's ``nargs`` and ``action``
    nargs: str | None = None
    action: builtins.type[argparse.Action] | None = None

    @property
    def dest(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    @property
    def help_text(self) -> str:
        shown = self.shown_default
        if shown is None and self.default is not None and not self.switch:
            shown = f"{self.default:g}" if isinstance(self.default, float) else str(self.default)
        return f"{self.help} (default {shown})" if shown else self.help


@dataclass(frozen=True, kw_only=True)
class Command:
    """A subcommand: its name, its line in ``pipetrain --help``, its flag table and what it runs.

    ``options`` is a function so that a table may read the application's names and defaults
    only when a parser is built (the command line imports the application lazily).
    """

    name: str
    help: str
    options: Callable[[], Sequence[Option]]
    run: Callable[[argparse.Namespace], int]
    #: parses the command's flags again from its command line, where parsed flags say to
    #: (``train --config FILE``); None: never
    reparse: Callable[[argparse.Namespace, Sequence[str]], argparse.Namespace] | None = None


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """Add each option of the table to ``parser``, in order, each group under its heading."""
    groups: dict[str, Any] = {}
    for opt in options:
        target: Any = parser
        if opt.group is not None:
            if opt.group not in groups:
                groups[opt.group] = parser.add_argument_group(opt.group)
            target = groups[opt.group]
        kwargs: dict[str, Any] = {"help": opt.help_text}
        if opt.switch:
            kwargs["action"] = "store_true"
        else:
            kwargs |= {"type": opt.type, "default": opt.default, "metavar": opt.metavar}
            kwargs |= {"choices": opt.choices, "action": opt.action}
            kwargs |= {"nargs": opt.nargs} if opt.nargs else {}
            kwargs |= {"required": True} if opt.required else {}
        if opt.flags[0].startswith("-"):
            kwargs["dest"] = opt.dest
        target.add_argument(*opt.flags, **{k: v for k, v in kwargs.items() if v is not None})


def one_of(flag: str, legal: tuple[str, ...], help: str) -> Option:
    """A flag that takes one of ``legal`` names, listed in its usage (``{ddp,fsdp}``)."""
    return Option((flag,), metavar="{" + ",".join(legal) + "}", choices=legal, help=help)


def with_defaults(options: Iterable[Option], defaults: object) -> tuple[Option, ...]:
    """The options with their defaults read from ``defaults`` (a config object), by dest."""
    return tuple(
        dataclasses.replace(opt, default=getattr(defaults, opt.dest))
        if hasattr(defaults, opt.dest)
        else opt
        for opt in options
    )


# -- validators -----------------------------------------------------------------------------


def positive_int(text: str) -> int:
    """An integer >= 1 (ranks, micro-batches, steps, sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rate, timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """Comma-separated integers >= 1 (``pipetrain plan --microbatches 4,8``)."""
    try:
        values = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers >= 1, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def one_positive_int(text: str) -> int:
    """One integer >= 1, checked as ``int_list`` checks each (``pipetrain plan``'s counts)."""
    (value,) = int_list(text)
    return value


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


def cost_value(text: str) -> float | tuple[float, ...]:
    """One non-negative finite number, or a comma-separated list with one per stage."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number >= 0 or a comma-separated list of them, got {text!r}"
        ) from None
    for v in values:
        if not 0 <= v <= MAX_COST:  # NaN fails too
            raise argparse.ArgumentTypeError(f"costs must be numbers in [0, {MAX_COST:g}], got {v}")
    return values[0] if len(values) == 1 else tuple(values)


# -- the shape flags ------------------------------------------------------------------------

#: dest → the flag that sets it, in the order a command line spells a shape
SHAPE_FLAGS: dict[str, str] = {
    "schedule": "--schedule",
    "ranks": "--ranks",
    "microbatches": "--microbatches",
    "stages_per_rank": "--stages-per-rank",
    "group_size": "--group-size",
}
#: where the schedule name given positionally or by ``--schedule`` is remembered (to catch both)
_SCHEDULE_GIVEN = "schedule_given"


class _ScheduleName(argparse.Action):
    """Stores the schedule from ``pipetrain show NAME`` or ``--schedule NAME``; both must agree.

    argparse calls the optional positional's action even when it is absent (with its default),
    so that value is ignored here; whether a schedule is required is the command's to check.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        if not isinstance(values, str) or values == argparse.SUPPRESS:
            return
        given = getattr(namespace, _SCHEDULE_GIVEN, None)
        if given is not None and given != values:
            parser.error(f"the schedule is given twice ({given} and {values}); give it once")
        setattr(namespace, _SCHEDULE_GIVEN, values)
        namespace.schedule = values


def schedule_options(
    families: Iterable[str] = tuple(FAMILIES), shown_default: str | None = None
) -> tuple[Option, Option]:
    """The schedule, positionally (``pipetrain show zbv``) or as ``--schedule/-s NAME``;
    ``shown_default``: the default the help names (it is resolved later, by the command)."""
    shown = f" (default {shown_default})" if shown_default else ""
    return (
        Option(
            ("--schedule", "-s"),
            action=_ScheduleName,
            metavar="NAME",
            help=f"schedule family: {', '.join(families)}{shown}",
            shown_default="",
        ),
        Option(
            ("schedule_positional",),
            nargs="?",
            action=_ScheduleName,
            default=argparse.SUPPRESS,
            metavar="SCHEDULE",
            help="the schedule family, as an alternative to --schedule",
            shown_default="",
        ),
    )


def ranks_option(required: bool = False, help: str = "pipeline ranks (GPUs)") -> Option:
    return Option(("--ranks", "-p"), type=positive_int, required=required, metavar="P", help=help)


def microbatches_option(required: bool = False, shown_default: str | None = None) -> Option:
    return Option(
        ("--microbatches", "-m"),
        type=positive_int,
        required=required,
        metavar="M",
        help="micro-batches per step",
        shown_default=shown_default,
    )


def stages_per_rank_option(families: Iterable[str] = tuple(FAMILIES)) -> Option:
    """``--stages-per-rank/-v``; the help names the families (of ``families``) that default to 2."""
    two = ", ".join(n for n in families if family(n).default_stages_per_rank == 2)
    return Option(
        ("--stages-per-rank", "-v"),
        type=positive_int,
        metavar="V",
        help=f"stages (model chunks) per rank (default the schedule's: 2 for {two}, else 1)",
    )


GROUP_SIZE = Option(
    ("--group-size",),
    type=positive_int,
    metavar="G",
    help="interleaved-1f1b only: micro-batch group size per virtual stage (default: the "
    "smallest legal size, ranks when it divides the micro-batches)",
)
WIDTH = Option(
    ("--width",),
    type=positive_int,
    metavar="COLS",
    help="columns to draw in (default: the terminal's width, 80 when it has none)",
)


def width_of(args: argparse.Namespace) -> int:
    """``--width``, else the terminal's (``COLUMNS`` when set, 80 when there is no terminal)."""
    width: int | None = args.width
    return width if width is not None else shutil.get_terminal_size().columns


def shape_flags_given(args: argparse.Namespace) -> list[str]:
    """The shape flags set in ``args`` (to name them when they do not apply)."""
    return [flag for dest, flag in SHAPE_FLAGS.items() if getattr(args, dest, None) is not None]


# -- the cost flags (simulate, compare) -----------------------------------------------------


def cost_options(per_rank: bool = False) -> tuple[Option, ...]:
    """The costs of one step's actions, per stage (``simulate``) or per rank's share (``compare``)."""
    group = (
        "costs (time units for one rank's share of the model; one number each)"
        if per_rank
        else "costs (time units per stage; one number, or a comma-separated list with one per stage)"
    )
    rows = (
        (("--forward", "-F"), 1.0, "F", "forward time", None),
        (("--backward-input", "-I"), 1.0, "I", "input-gradient time", None),
        (("--backward-weight", "-W"), 1.0, "W", "weight-gradient time", None),
        (("--backward", "-B"), None, "B", "full backward time", "I + W"),
        (("--forward-backward",), None, "FB", "overlapped F&B pair time", "F + B"),
        (("--comm", "-C"), 0.0, "C", "latency on every cross-rank dependency", None),
        (("--activation",), 1.0, "A", "activation size of one micro-batch per stage", None),
        (
            ("--activation-for-weight",),
            None,
            "AW",
            "activation held between a split backward's I and W",
            "A",
        ),
        (
            ("--workspace",),
            0.0,
            "WS",
            "memory an action uses only while it runs, in activation units",
            None,
        ),
    )
    return tuple(
        Option(
            flags,
            type=cost_value,
            default=default,
            metavar=metavar,
            help=help,
            shown_default=shown,
            group=group,
        )
        for flags, default, metavar, help, shown in rows
    )


def costs_from(args: argparse.Namespace) -> Costs:
    return Costs(
        forward=args.forward,
        backward_input=args.backward_input,
        backward_weight=args.backward_weight,
        backward=args.backward,
        forward_backward=args.forward_backward,
        comm=args.comm,
        activation=args.activation,
        activation_for_weight=args.activation_for_weight,
        workspace=args.workspace,
    )


# -- the model flags (profile, train) -------------------------------------------------------


def model_options() -> tuple[Option, ...]:
    """The flags that define the model, with ``TrainConfig``'s defaults: ``pipetrain profile``
    and ``pipetrain train`` take the same ones, so a costs file and a run describe one model."""
    from pipetrain.app.config import CHOICES, TrainConfig

    table = (
        one_of("--model", CHOICES["model"], "model"),
        Option(("--layers",), type=positive_int, metavar="L", help="transformer blocks"),
        Option(
            ("--hidden",),
            type=positive_int,
            metavar="H",
            help="hidden size (a multiple of --heads)",
        ),
        Option(("--heads",), type=positive_int, metavar="N", help="attention heads"),
        Option(
            ("--kv-heads",),
            type=positive_int,
            metavar="N",
            help="key/value heads (Hugging Face models)",
        ),
        Option(
            ("--vocab",),
            type=positive_int,
            metavar="V",
            help="vocabulary size (tokens are bytes: >= 256)",
        ),
        Option(("--seq-len",), type=positive_int, metavar="T", help="tokens (bytes) per sequence"),
        Option(
            ("--tie-embeddings",),
            switch=True,
            help="tie the LM head to the token embedding (Hugging Face models; FSDP2 + ties "
            "refused on NCCL)",
        ),
        one_of("--dtype", CHOICES["dtype"], "parameter and activation dtype"),
        Option(("--seed",), type=int, metavar="S", help="seed for the weights and the batches"),
        Option(
            ("--microbatch-size", "--micro-batch-size"),
            type=positive_int,
            metavar="B",
            help="sequences per micro-batch",
        ),
    )
    return with_defaults(table, TrainConfig())


def folder_options() -> tuple[Option, ...]:
    """``--model-dir``: fine-tune a local Hugging Face folder instead of building a model;
    ``--export``: write the result as one."""
    return (
        Option(
            ("--model-dir",),
            metavar="DIR",
            help="fine-tune the Hugging Face model in DIR (config.json, safetensors files, "
            "tokenizer; Llama family, GPT-2, or the mixture-of-experts Qwen2-MoE, Qwen3-MoE, "
            "Mixtral, GPT-OSS): its config gives the model, so the model flags "
            "below do not apply; the text is tokenized by its tokenizer, rows right-padded",
            group="a Hugging Face model folder",
        ),
        Option(
            ("--export",),
            metavar="DIR",
            help="with --model-dir: write the trained model there at the end, a Hugging Face "
            "folder (safetensors, config, tokenizer) that transformers loads",
            group="a Hugging Face model folder",
        ),
        Option(
            ("--overwrite-export",),
            switch=True,
            help="replace what the --export folder holds (without it, a non-empty one is refused)",
            group="a Hugging Face model folder",
        ),
    )


def model_shape(args: argparse.Namespace) -> ModelShape:
    """The model the model flags in ``args`` describe, read as ``pipetrain train`` reads them."""
    from pipetrain.app.config import TrainConfig

    return TrainConfig(**{opt.dest: getattr(args, opt.dest) for opt in model_options()}).shape
