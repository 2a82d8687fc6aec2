"""The top of the command line: ``pipetrain COMMAND``, one module per command.

``build_parser`` builds every command's parser from its flag table (``flags.Command``); ``main``
dispatches to the command and turns bad input into exit status 2 with a one-line message naming
the problem and the legal values, never a traceback. torch is imported only by ``profile``,
``train`` and ``demo`` (lazily, after checking it is installed), so planning commands run
anywhere.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipetrain.cli import (
    compare_command,
    demo_command,
    export_command,
    plan_command,
    profile_command,
    schedules_command,
    show_command,
    simulate_command,
    train_command,
    verify_command,
)
from pipetrain.cli.flags import PROG, Command, add_options

#: in the order ``pipetrain --help`` lists them
COMMANDS: tuple[Command, ...] = (
    schedules_command.COMMAND,
    show_command.COMMAND,
    simulate_command.COMMAND,
    compare_command.COMMAND,
    plan_command.COMMAND,
    profile_command.COMMAND,
    train_command.COMMAND,
    export_command.COMMAND,
    verify_command.COMMAND,
    demo_command.COMMAND,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Pipeline-parallel schedules: build, check, simulate, draw and train.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        add_options(sub.add_parser(command.name, help=command.help), command.options())
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name: str = args.command
    run = next(command.run for command in COMMANDS if command.name == name)
    try:
        return run(args)
    except ValueError as e:  # ScheduleError and UsageError are ValueErrors
        print(f"{PROG} {name}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except OSError as e:  # an output path that cannot be written
        print(f"{PROG} {name}: error: cannot write {e.filename!r}: {e.strerror}", file=sys.stderr)
        return 2
