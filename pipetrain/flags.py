"""The command line's shared vocabulary: the shape flags, their validators, and how a shape reads.

A pipeline's shape is named the same way in every subcommand — schedule, ranks, micro-batches,
stages per rank, micro-batch group size — so each flag, its help text and its check are defined
here once; ``pipetrain show``, ``simulate``, ``compare`` and ``train`` add the ones they take.
Validators raise ``argparse.ArgumentTypeError``, which argparse reports as a one-line usage error
(exit 2, no traceback). Only the standard library and the schedule registry are imported, so
``--help`` stays fast and planning commands need no torch.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterable, Sequence
from typing import Any

from pipetrain.schedule.registry import FAMILIES, family

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


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 rank``, ``4 ranks``; ``many`` for irregular plurals."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def describe_shape(name: str, num_ranks: int, stages_per_rank: int | None, num_mb: int) -> str:
    """The one-line shape every command prints: ``zbv: 4 ranks, 2 stages per rank, 8 micro-batches``.

    ``stages_per_rank`` None means the placement gives ranks different numbers of stages.
    """
    per_rank = (
        f"{plural(stages_per_rank, 'stage')} per rank" if stages_per_rank else "uneven stages"
    )
    return f"{name}: {plural(num_ranks, 'rank')}, {per_rank}, {plural(num_mb, 'micro-batch', 'micro-batches')}"


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


def add_schedule(
    parser: argparse.ArgumentParser,
    families: Iterable[str] = tuple(FAMILIES),
    default: str | None = None,
    shown_default: str | None = None,
) -> None:
    """The schedule, positionally (``pipetrain show zbv``) or as ``--schedule/-s NAME``;
    ``shown_default``: the default the help names when it is not ``default`` (resolved later)."""
    names = ", ".join(families)
    shown_default = shown_default or default
    shown = f" (default {shown_default})" if shown_default else ""
    parser.add_argument(
        "--schedule",
        "-s",
        action=_ScheduleName,
        default=default,
        metavar="NAME",
        help=f"schedule family: {names}{shown}",
    )
    parser.add_argument(
        "schedule_positional",
        nargs="?",
        action=_ScheduleName,
        default=argparse.SUPPRESS,
        metavar="SCHEDULE",
        help="the schedule family, as an alternative to --schedule",
    )


def add_ranks(
    parser: argparse.ArgumentParser,
    required: bool = False,
    default: int | None = None,
    help: str = "pipeline ranks (GPUs)",
) -> None:
    shown = f" (default {default})" if default is not None else ""
    parser.add_argument(
        "--ranks",
        "-p",
        type=positive_int,
        required=required,
        default=default,
        metavar="P",
        help=help + shown,
    )


def add_microbatches(
    parser: argparse.ArgumentParser,
    required: bool = False,
    default: int | None = None,
    shown_default: str | None = None,
) -> None:
    shown_default = shown_default or (str(default) if default is not None else None)
    shown = f" (default {shown_default})" if shown_default is not None else ""
    parser.add_argument(
        "--microbatches",
        "-m",
        type=positive_int,
        required=required,
        default=default,
        metavar="M",
        help=f"micro-batches per step{shown}",
    )


def add_stages_per_rank(
    parser: argparse.ArgumentParser, families: Iterable[str] = tuple(FAMILIES)
) -> None:
    """``--stages-per-rank/-v``; the help names the families (of ``families``) that default to 2."""
    two = ", ".join(n for n in families if family(n).default_stages_per_rank == 2)
    parser.add_argument(
        "--stages-per-rank",
        "-v",
        type=positive_int,
        metavar="V",
        help=f"stages (model chunks) per rank (default the schedule's: 2 for {two}, else 1)",
    )


def add_group_size(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--group-size",
        type=positive_int,
        metavar="G",
        help="interleaved-1f1b only: micro-batch group size per virtual stage (default: the "
        "smallest legal size, ranks when it divides the micro-batches)",
    )


def add_width(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--width",
        type=positive_int,
        metavar="COLS",
        help="columns to draw in (default: the terminal's width, 80 when it has none)",
    )


def width_of(args: argparse.Namespace) -> int:
    """``--width``, else the terminal's (``COLUMNS`` when set, 80 when there is no terminal)."""
    width: int | None = args.width
    return width if width is not None else shutil.get_terminal_size().columns


def shape_argv(args: argparse.Namespace) -> list[str]:
    """The shape flags that reproduce the shape in ``args`` (for a relaunched process)."""
    out: list[str] = []
    for dest, flag in SHAPE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None:
            out += [flag, str(value)]
    return out


def shape_flags_given(args: argparse.Namespace) -> list[str]:
    """The shape flags set in ``args`` (to name them when they do not apply)."""
    return [flag for dest, flag in SHAPE_FLAGS.items() if getattr(args, dest, None) is not None]
