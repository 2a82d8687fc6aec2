"""``pipetrain report METRICS``: draw a training run's metrics file (``train --metrics``) as SVG,
the loss and the held-out loss over the steps above the learning rate (``app.metrics_chart``).
Needs no torch: it reads JSON lines and writes SVG."""

from __future__ import annotations

import argparse

from pipetrain.cli.flags import Command, Option

HELP = "draw a run's --metrics file (loss, eval loss, learning rate over the steps) as SVG"


def options() -> tuple[Option, ...]:
    return (
        Option(("metrics",), metavar="METRICS", help="the JSON-lines file train --metrics wrote"),
        Option(
            ("--out",),
            metavar="FILE.svg",
            help="where to write the SVG",
            shown_default="METRICS with the suffix .svg",
        ),
    )


def run(args: argparse.Namespace) -> int:
    from pipetrain.app.metrics_chart import write_chart

    try:
        path = write_chart(args.metrics, args.out)
    except FileNotFoundError:
        raise ValueError(f"{args.metrics}: no such file") from None
    print(f"wrote {path}")
    return 0


COMMAND = Command(name="report", help=HELP, options=options, run=run)
