"""``pipetrain export``: a checkpoint of a ``--model-dir`` run written as a Hugging Face folder, on
the CPU, in one process, without the original folder (``app.checkpoint_export``)."""

from __future__ import annotations

import argparse

from pipetrain.cli.flags import Command, Option, require_torch

OPTIONS = (
    Option(
        ("--checkpoint",),
        metavar="DIR",
        required=True,
        help="a checkpoint folder (step-N), or a --checkpoint-dir: its latest complete checkpoint",
    ),
    Option(
        ("--out",),
        metavar="DIR",
        required=True,
        help="the Hugging Face folder to write (made if missing; must be empty)",
    ),
    Option(("--overwrite",), switch=True, help="replace what the --out folder holds"),
)


def run(args: argparse.Namespace) -> int:
    require_torch()
    from pipetrain.app.checkpoint_export import export_checkpoint

    step = export_checkpoint(args.checkpoint, args.out, overwrite=args.overwrite)
    print(f"exported {step} to {args.out} (a Hugging Face model folder)")
    return 0


COMMAND = Command(
    name="export",
    help="write a --model-dir run's checkpoint as a Hugging Face folder (CPU, no training)",
    options=lambda: OPTIONS,
    run=run,
)
