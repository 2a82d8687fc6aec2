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
    report_command,
    schedules_command,
    show_command,
    simulate_command,
    synthesize_command,
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
    synthesize_command.COMMAND,
    profile_command.COMMAND,
    train_command.COMMAND,
    report_command.COMMAND,
    export_command.COMMAND,
    verify_command.COMMAND,
    demo_command.COMMAND,
)


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: a prefix (--data) is never taken for a longer flag (--data-parallel)
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Pipeline-parallel schedules: build, check, simulate, draw and train.",
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        add_options(
            sub.add_parser(command.name, help=command.help, allow_abbrev=False), command.options()
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    name: str = args.command
    command = next(command for command in COMMANDS if command.name == name)
    try:
        if command.reparse is not None:
            args = command.reparse(args, argv[argv.index(name) + 1 :])
        return command.run(args)
    except ValueError as e:  # ScheduleError and UsageError are ValueErrors
        print(f"{PROG} {name}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0
    except OSError as e:  # an output path that cannot be written
        print(f"{PROG} {name}: error: cannot write {e.filename!r}: {e.strerror}", file=sys.stderr)
        return 2
