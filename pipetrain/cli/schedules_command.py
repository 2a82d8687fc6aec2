"""``pipetrain schedules``: every schedule family with its summary and constraints."""

from __future__ import annotations

import argparse
import textwrap

from pipetrain.cli.flags import WIDTH, Command, width_of
from pipetrain.schedule.registry import FAMILIES

OPTIONS = (WIDTH,)


def run(args: argparse.Namespace) -> int:
    name_w = max(len(n) for n in FAMILIES)
    indent = " " * (name_w + 2)
    for fam in FAMILIES.values():
        text = f"{fam.summary}\nconstraints: {fam.constraints}"
        lines = [
            line
            for para in text.splitlines()
            for line in textwrap.wrap(
                para, max(40, width_of(args) - len(indent)), break_on_hyphens=False
            )
        ]
        print(f"{fam.name:<{name_w}}  {lines[0]}")
        for line in lines[1:]:
            print(indent + line)
    return 0


COMMAND = Command(
    name="schedules",
    help="list every schedule with its constraints",
    options=lambda: OPTIONS,
    run=run,
)
