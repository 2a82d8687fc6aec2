"""A failed ``pipetrain train`` worker's traceback goes to a log file, and the launcher says the
cause in one line.

Every rank of a pipeline fails when one does (the others hear of it: ``runtime.comm.failures``),
so a run that stopped on a full disk used to print each rank's traceback, library frames and
the peers' "rank 1 failed" included, with the cause somewhere in the middle. Instead each failed
worker writes ``rank-R.log`` (R the global rank) in the run's log folder
(``<--checkpoint-dir>/logs``, else ``out/logs``): a first line with its cause, then the
traceback. The launcher reads the first lines once every worker has stopped and prints one:
the cause of a rank that failed on its own (not one that only heard of a peer's failure),
where the latest good checkpoint is, and where the logs are.

The cause of an ``OSError`` (found anywhere in the exception's chain, including the per-rank
failures ``torch.distributed.checkpoint`` collects) is named by its errno symbol and path — a
full disk is ``ENOSPC``, a file-size limit ``EFBIG`` — with, for ``ENOSPC``, the bytes free
where the path is and the bytes needed where the error carries them (``needed_bytes``).
"""

from __future__ import annotations

import errno
import re
import shutil
import traceback
from pathlib import Path
from typing import Any

#: the first line of a log: the cause of a rank that failed on its own, or that heard of a peer's
OWN, HEARD = "cause: ", "heard: "
_LOG = re.compile(r"rank-(\d+)\.log")


def log_folder(config: Any) -> Path:
    """Where a run's worker logs go: ``<--checkpoint-dir>/logs``, else ``out/logs``."""
    return Path(config.checkpoint_dir or "out") / "logs"


def clear_logs(folder: Path) -> None:
    """Remove the worker logs of an earlier run (so that none is taken for this run's)."""
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        if _LOG.fullmatch(path.name):
            path.unlink(missing_ok=True)


def write_log(folder: Path, rank: int, error: BaseException) -> bool:
    """Write ``rank``'s cause and traceback to ``folder/rank-R.log``; False where it cannot be
    written (the disk may be the one that is full): the caller prints the traceback instead."""
    head = (HEARD if heard_from_peer(error) else OWN) + cause_of(error)
    text = head + "\n\n" + "".join(traceback.format_exception(error))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank-{rank}.log").write_text(text)
    except OSError:
        return False
    return True


def read_cause(folder: Path) -> tuple[int, str] | None:
    """The rank and cause the launcher reports: the lowest rank that failed on its own, else the
    lowest that heard of a peer's failure; None where no worker wrote a log."""
    found: list[tuple[bool, int, str]] = []
    if not folder.is_dir():
        return None
    for path in folder.iterdir():
        match = _LOG.fullmatch(path.name)
        if match is None:
            continue
        try:
            with path.open() as f:
                first = f.readline().rstrip("\n")
        except OSError:
            continue
        for mark, heard in ((OWN, False), (HEARD, True)):
            if first.startswith(mark):
                found.append((heard, int(match.group(1)), first.removeprefix(mark)))
    if not found:
        return None
    _, rank, cause = min(found)
    return rank, cause


def heard_from_peer(error: BaseException) -> bool:
    """Whether ``error`` only says that a peer failed (a notice it read, or a closed connection)."""
    from pipetrain.runtime.comm.failures import PeerFailedError, closed_connection

    if isinstance(error, PeerFailedError) or getattr(error, "notice", None) is not None:
        return True
    return closed_connection(error) if isinstance(error, Exception) else False


def cause_of(error: BaseException) -> str:
    """``error`` in one line: an ``OSError`` in its chain by errno symbol, message and path (and
    the space it needed and found, for a full disk), else its type and first line."""
    found = _os_error(error)
    if found is None:
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    symbol = errno.errorcode.get(found.errno or 0, "")
    what = f"{type(found).__name__} {symbol}".strip()
    text = f"{what} ({found.strerror or found})"
    path = found.filename
    if path is not None:
        text += f": {path}"
    if found.errno == errno.ENOSPC:
        text += _space(found, path)
    return text


def _space(error: OSError, path: object) -> str:
    needed = getattr(error, "needed_bytes", None)
    free = _free_bytes(Path(str(path))) if path is not None else None
    parts = []
    if needed is not None:
        parts.append(f"{int(needed):,} bytes needed")
    if free is not None:
        parts.append(f"{free:,} bytes free there")
    return f" ({', '.join(parts)})" if parts else ""


def _free_bytes(path: Path) -> int | None:
    """The bytes free on the file system holding ``path`` (its nearest existing folder)."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def _os_error(error: BaseException) -> OSError | None:
    """The first ``OSError`` in ``error``'s chain (causes, contexts, and the per-rank failures a
    ``torch.distributed.checkpoint.CheckpointException`` holds), depth first."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno is not None:
            return e
        nested = [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # CheckpointException: rank -> (exception, trace)
            nested += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [n for n in nested if isinstance(n, BaseException)]
    return None


__all__ = [
    "HEARD",
    "OWN",
    "cause_of",
    "clear_logs",
    "heard_from_peer",
    "log_folder",
    "read_cause",
    "write_log",
]
