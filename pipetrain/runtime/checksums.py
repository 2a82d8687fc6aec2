"""``SHA256SUMS``: a folder's files and their SHA-256, checked before the folder is trusted.

A checkpoint or an exported model is only as good as its bytes: a shard damaged after it was
written (a bad disk, a partial copy between machines, a bit flipped in transit) has the right
size and a valid header, so checks of structure pass and the damage loads silently. The writer
hashes each file from the bytes it has just written and lists them in ``SHA256SUMS``, in the
format ``sha256sum`` writes and checks (``<hex>  <path>``, paths relative to the folder), so a
folder can also be checked without pipetrain: ``cd DIR && sha256sum -c SHA256SUMS``.

Standard library only: the application and the command line check folders without torch.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

SUMS = "SHA256SUMS"
_LINE = re.compile(r"([0-9a-f]{64}) [ *](.+)")


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, as hex."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def hash_files(folder: Path, names: Iterable[str]) -> dict[str, str]:
    """``{name: sha256}`` of the files ``names`` (relative to ``folder``)."""
    return {name: file_sha256(folder / name) for name in names}


def write_sums(folder: Path, sums: Mapping[str, str]) -> None:
    """Write ``folder/SHA256SUMS`` (sorted by path), whole or not at all."""
    for name in sums:
        if name == SUMS or Path(name).is_absolute() or ".." in Path(name).parts:
            raise ValueError(f"{name!r} cannot be listed in {SUMS}: give a path inside the folder")
    text = "".join(f"{sums[name]}  {name}\n" for name in sorted(sums))
    tmp = folder / f"{SUMS}.tmp"
    tmp.write_text(text)
    tmp.replace(folder / SUMS)


def read_sums(folder: Path) -> dict[str, str]:
    """``{path: sha256}`` from ``folder/SHA256SUMS``; a ``ValueError`` naming the folder when it is
    missing or a line is not ``<hex>  <path>``."""
    file = folder / SUMS
    try:
        lines = file.read_text().splitlines()
    except FileNotFoundError:
        raise ValueError(
            f"{folder} has no {SUMS}: its files cannot be checked (written before checksums, "
            "or not by pipetrain)"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} cannot be read ({e})") from None
    sums: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        match = _LINE.fullmatch(line)
        if match is None:
            raise ValueError(f"{file} is damaged: line {number} is not '<sha256>  <path>'")
        sums[match.group(2)] = match.group(1)
    return sums


def damaged(folder: Path, names: Iterable[str] | None = None) -> list[str]:
    """What is wrong with ``folder``'s files against its ``SHA256SUMS`` (only ``names`` where
    given): one line per missing or changed file, empty when every one verifies; a
    ``ValueError`` where ``SHA256SUMS`` itself is missing or damaged."""
    sums = read_sums(folder)
    wanted = sorted(sums) if names is None else list(names)
    problems = []
    for name in wanted:
        path = folder / name
        if name not in sums:
            problems.append(f"{path} is not listed in {folder / SUMS}")
        elif not path.is_file():
            problems.append(f"{path} is missing")
        elif file_sha256(path) != sums[name]:
            problems.append(f"{path} is damaged (its SHA-256 is not the one {SUMS} records)")
    return problems


def verify(folder: Path, names: Iterable[str] | None = None) -> None:
    """``damaged``, raised: a ``ValueError`` naming the first file at fault."""
    problems = damaged(folder, names)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(problems[0] + more)


__all__ = ["SUMS", "damaged", "file_sha256", "hash_files", "read_sums", "verify", "write_sums"]
