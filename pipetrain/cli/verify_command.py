"""``pipetrain verify DIR``: a checkpoint, every checkpoint of a ``--checkpoint-dir``, or an
exported model folder checked against its ``SHA256SUMS`` (and its structure: DCP's metadata and
shard sizes, safetensors headers). Exit 0 when all verify, 1 when one is damaged (each file at
fault named), 2 for a folder that is none of these."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipetrain.cli.flags import Command, Option, UsageError

OPTIONS = (
    Option(
        ("folder",),
        metavar="DIR",
        help="a checkpoint (step-N), a --checkpoint-dir, or a model folder written by --export "
        "or pipetrain export",
        shown_default="",
    ),
)


def problems_of(folder: Path) -> list[str]:
    """What is wrong with one checkpoint or model folder: empty when it verifies."""
    from pipetrain.runtime import checksums

    found: list[str] = []
    try:
        if (folder / ".metadata").is_file():
            from pipetrain.runtime.checkpoint_disk import verify

            verify(folder)
        else:
            from pipetrain.hf.folder_check import folder_tensors

            folder_tensors(folder)
    except (OSError, ValueError) as e:
        found.append(str(e))
    try:
        found += checksums.damaged(folder)
    except ValueError as e:
        found.append(str(e))
    return found


def folders_of(given: Path) -> list[Path]:
    """The folders ``given`` names: its checkpoints (a checkpoint root), or itself."""
    from pipetrain.app.checkpoints import checkpoint_folders

    steps = checkpoint_folders(given)
    if steps:
        return steps
    if (given / ".metadata").is_file() or (given / "SHA256SUMS").is_file():
        return [given]
    if any(given.glob("*.safetensors")):
        return [given]
    raise UsageError(
        f"{given} is neither a checkpoint (no .metadata), a checkpoint directory (no step-* "
        "folders) nor a model folder (no safetensors files)"
    )


def run(args: argparse.Namespace) -> int:
    from pipetrain.runtime.checkpoint_disk import PARTIAL

    given = Path(args.folder)
    if not given.is_dir():
        raise UsageError(f"{given}: no such folder")
    bad = 0
    for folder in folders_of(given):
        if folder.name.endswith(PARTIAL):
            print(f"skipped  {folder} (incomplete: a run stopped while writing it)")
            continue
        found = problems_of(folder)
        if not found:
            print(f"OK       {folder}")
            continue
        bad += 1
        print(f"DAMAGED  {folder}")
        for line in found:
            print(f"  {line}")
    return 1 if bad else 0


COMMAND = Command(
    name="verify",
    help="check a checkpoint or exported model folder against its SHA256SUMS",
    options=lambda: OPTIONS,
    run=run,
)
