"""A checkpoint's folder on disk: written whole or not at all, and checked before it is read.

``runtime.checkpoint`` writes and reads the state; this module owns the folder around it.

* **Written whole.** DCP writes into ``<path>.partial``; once every process is done, the
  coordinator renames it to ``<path>``. A process killed while writing (SIGKILL, a lost node)
  leaves a ``.partial`` folder, never a ``<path>`` that looks complete and is not; the next save
  to the same path removes it.
* **Marked complete.** The coordinator writes ``COMPLETE`` last, once DCP's ``.metadata``,
  every shard and ``SHA256SUMS`` are on disk (Orbax marks a finished checkpoint the same way,
  with ``commit_success.txt``, where a store cannot rename). The rename already hides a
  half-written folder on a POSIX disk; the marker also tells a folder copied by hand, or one
  whose removal (``--keep-checkpoints``) was cut short, from a whole one. Its text is fixed, so
  ``SHA256SUMS`` lists it and ``sha256sum -c`` fails until it is there.
* **Checked before read** (``verify``): the folder has DCP's ``.metadata``, it unpickles, and
  every file it names is there and holds every byte range the metadata points into, and it is
  marked complete. A truncated, empty or missing shard is refused naming the file, before any
  tensor is read (DCP would fail in the middle of reading, with an ``EOFError`` naming no
  file).
* **Read failures in one line** (``read_failure``): what DCP raised on whichever rank, as a
  ``ValueError`` naming the folder, the rank and the first error, without DCP's tracebacks.

torch is imported inside functions (``verify``), so the application can name a folder's state
without it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

#: the suffix of a checkpoint being written (or whose writer died)
PARTIAL = ".partial"
#: DCP's metadata file, written last by the coordinator
METADATA = ".metadata"
#: the file written last, once everything else in the folder is on disk
COMPLETE = "COMPLETE"
#: what ``COMPLETE`` holds (fixed, so that ``SHA256SUMS`` can list it before it is written)
COMPLETE_TEXT = "pipetrain checkpoint: .metadata, every shard and SHA256SUMS were written first\n"


def partial_path(path: str | os.PathLike[str]) -> Path:
    """Where a checkpoint for ``path`` is written before it is complete."""
    final = Path(path)
    return final.with_name(final.name + PARTIAL)


def remove(path: Path) -> None:
    """Remove a folder (or file) if it is there; a checkpoint's ``COMPLETE`` marker first, so that
    a removal cut short leaves a folder that reads as incomplete."""
    if path.is_dir() and not path.is_symlink():
        (path / COMPLETE).unlink(missing_ok=True)
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def publish(partial: Path, final: Path) -> None:
    """Make a complete checkpoint visible under its name (replacing an older one there): the
    name never points at a half-written folder."""
    if not final.exists():
        partial.rename(final)
        return
    old = final.with_name(final.name + ".old")
    remove(old)
    final.rename(old)
    partial.rename(final)
    remove(old)


def verify(path: str | os.PathLike[str]) -> Any:
    """The checkpoint's DCP metadata, after checking that the folder is complete: a
    ``ValueError`` naming the folder, and the file at fault, otherwise."""
    import torch.distributed.checkpoint as dcp

    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"checkpoint {folder}: no such folder")
    meta_file = folder / METADATA
    if not meta_file.is_file():
        raise ValueError(
            f"checkpoint {folder} is incomplete: it has no {METADATA} (DCP writes it last)"
        )
    try:
        metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    except Exception as e:
        raise ValueError(
            f"checkpoint {folder} is corrupt: {meta_file} cannot be read ({_one_line(e)})"
        ) from None
    need: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    for name, end in sorted(need.items()):
        file = folder / name
        if not file.is_file():
            raise ValueError(f"checkpoint {folder} is incomplete: {file} is missing")
        size = file.stat().st_size
        if size < end:
            raise ValueError(
                f"checkpoint {folder} is corrupt: {file} has {size} bytes, its tensors need "
                f"{end} (a truncated or partly copied shard)"
            )
    if not (folder / COMPLETE).is_file() and not _before_markers(folder):
        raise ValueError(
            f"checkpoint {folder} is incomplete: it has no {COMPLETE} marker (written last, once "
            "its metadata, shards and SHA256SUMS are; a copy or a removal cut short?)"
        )
    return metadata


def _before_markers(folder: Path) -> bool:
    """Whether ``folder`` was written before checkpoints were marked: its ``SHA256SUMS`` (which
    every writer since lists ``COMPLETE`` in) does not name the marker."""
    try:
        text = (folder / "SHA256SUMS").read_text()
    except (OSError, UnicodeDecodeError):
        return False
    return not any(line.endswith(f"  {COMPLETE}") for line in text.splitlines())


def read_failure(path: str | os.PathLike[str], error: BaseException) -> ValueError:
    """A one-line ``ValueError`` for DCP's failure to read ``path`` (its ``CheckpointException``
    carries every failing rank's exception and traceback)."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        cause = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        what = f"rank {rank}: {_one_line(cause)}"
    else:
        what = _one_line(error)
    return ValueError(f"checkpoint {path} could not be read ({what}); is it corrupt?")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


__all__ = [
    "COMPLETE",
    "COMPLETE_TEXT",
    "METADATA",
    "PARTIAL",
    "partial_path",
    "publish",
    "read_failure",
    "remove",
    "verify",
]
