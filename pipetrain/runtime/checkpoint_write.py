"""A checkpoint folder written by every process, hashed by its writers, published or removed.

``runtime.checkpoint`` decides what state goes in; this module owns the write around it:

* **Hashed by the writers.** DCP names each process's files after its rank in the group
  (``__<rank>_<n>.distcp``), so each process hashes its own files right after writing them, in
  parallel with the others, and the coordinator adds its own (``.metadata``, the small files it
  writes) and writes ``SHA256SUMS`` (``runtime.checksums``) before the folder is published. A
  checkpoint therefore never appears without the sums its loaders verify.
* **Marked complete last** (``runtime.checkpoint_disk``'s ``COMPLETE``): after the sums, before
  the rename, so neither a reader nor ``--keep-checkpoints`` takes a folder for whole too early.
* **Written in two halves** (``begin_folder``, ``end_folder``): the synchronous save runs them
  back to back (``write_folder``); the asynchronous one (``runtime.checkpoint_async``) runs the
  second on its background thread, on a process group of its own, once DCP's upload is done.
* **Nothing half-written.** A write that fails — a full disk (``ENOSPC``), a file-size limit
  (``EFBIG``), on any process — removes the ``.partial`` folder on every process and raises an
  ``OSError`` on every one of them, keeping the first failure's ``errno`` and path, so a caller
  can say what filled up without DCP's tracebacks.
"""

from __future__ import annotations

import errno
import hashlib
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch.distributed as dist

from pipetrain.runtime import checkpoint_disk, checksums
from pipetrain.runtime.comm.barrier import barrier


def write_folder(
    final: Path,
    processes: dict,
    save: Callable[[Path], None],
    files: Mapping[str, str | bytes] | None = None,
    then: Callable[[Path], None] | None = None,
) -> None:
    """Write a checkpoint at ``final``: ``save(partial)`` on every process (DCP's collective
    save), then ``files`` (name → text or bytes, names may hold a subfolder), ``SHA256SUMS`` and
    the ``COMPLETE`` marker by the coordinator, then the rename, then ``then(final)`` on the
    coordinator (the run's ``latest`` pointer). Collective over ``processes``
    (``runtime.checkpoint.checkpoint_processes``); raises the same ``OSError`` on every process
    where any write failed."""
    partial = begin_folder(final, processes)
    failure: OSError | None = None
    try:
        save(partial)
    except BaseException as e:  # DCP raises any rank's failure on every rank
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        failure = os_error(e, partial)
    end_folder(final, processes, failure, files, then)


def begin_folder(final: Path, processes: dict) -> Path:
    """The folder a checkpoint for ``final`` is written into, emptied of what a writer killed
    earlier left there before any process writes. Collective."""
    partial = checkpoint_disk.partial_path(final)
    group = _Group(processes)
    if group.lead:
        checkpoint_disk.remove(partial)
    group.barrier()
    return partial


def end_folder(
    final: Path,
    processes: dict,
    failure: OSError | None,
    files: Mapping[str, str | bytes] | None = None,
    then: Callable[[Path], None] | None = None,
) -> None:
    """After every process's part of the write (``failure``: this process's, or None): each
    hashes its own files, the coordinator completes and publishes the folder and calls
    ``then(final)``; agreed, so a failure anywhere raises the same ``OSError`` everywhere and
    the unfinished folder is removed. Collective; returns on every process only after ``then``
    returned."""
    partial = checkpoint_disk.partial_path(final)
    group = _Group(processes)
    mine: dict[str, str] = {}
    if failure is None:
        try:
            mine = checksums.hash_files(partial, own_files(partial, group.rank))
        except OSError as e:
            failure = os_error(e, partial)
    failure = group.first(failure)
    if failure is None:
        sums = {name: digest for part in group.gather(mine) for name, digest in part.items()}
        if group.lead:
            try:
                _finish(partial, final, sums, files or {})
                if then is not None:
                    then(final)
            except OSError as e:
                failure = os_error(e, partial)
        failure = group.first(failure, lead_only=True)
    if failure is not None:
        shutil.rmtree(partial, ignore_errors=True)
        group.barrier()
        raise failure


def own_files(folder: Path, rank: int) -> list[str]:
    """The data files DCP wrote for the process of ``rank`` in the checkpoint's group."""
    mine = re.compile(rf"__{rank}_\d+\.distcp")
    return sorted(p.name for p in folder.iterdir() if mine.fullmatch(p.name))


def _finish(
    partial: Path, final: Path, sums: dict[str, str], files: Mapping[str, str | bytes]
) -> None:
    """The coordinator's part: the small files, the metadata's hash, ``SHA256SUMS``, the rename."""
    for name, content in files.items():
        path = partial / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    names = [checkpoint_disk.METADATA, *files]
    sums = {**sums, **checksums.hash_files(partial, names)}
    # the marker's text is fixed: listed before it is written, so sha256sum -c fails without it
    marker = checkpoint_disk.COMPLETE_TEXT.encode()
    sums[checkpoint_disk.COMPLETE] = hashlib.sha256(marker).hexdigest()
    checksums.write_sums(partial, sums)
    (partial / checkpoint_disk.COMPLETE).write_bytes(marker)
    checkpoint_disk.publish(partial, final)


def os_error(error: BaseException, partial: Path) -> OSError:
    """The ``OSError`` behind ``error`` (DCP wraps each rank's failure in a
    ``CheckpointException``), its errno and path kept; another failure as ``EIO`` on the
    folder."""
    found = _find_os_error(error)
    if found is not None:
        return OSError(found.errno, found.strerror or str(found), found.filename or str(partial))
    text = " ".join(str(error).split())[:300]
    return OSError(
        errno.EIO, f"writing the checkpoint failed ({type(error).__name__}: {text})", str(partial)
    )


def _find_os_error(error: BaseException | None) -> OSError | None:
    seen = 0
    while error is not None and seen < 10:
        if isinstance(error, OSError) and error.errno is not None:
            return error
        failures = getattr(error, "failures", None)
        if isinstance(failures, dict) and failures:
            for rank in sorted(failures):
                cause = failures[rank]
                cause = cause[0] if isinstance(cause, tuple) else cause
                found = _find_os_error(cause)
                if found is not None:
                    return found
        error = error.__cause__ or error.__context__
        seen += 1
    return None


class _Group:
    """The checkpoint's processes (``runtime.checkpoint.checkpoint_processes``: alone, a group, or
    the whole job where the group is ``None``)."""

    def __init__(self, processes: dict) -> None:
        self.alone = bool(processes.get("no_dist"))
        self.group = None if self.alone else processes["process_group"]
        self.rank = 0 if self.alone else dist.get_rank(self.group)
        self.lead = self.rank == 0

    def barrier(self) -> None:
        if not self.alone:
            barrier(self.group)

    def gather(self, value: object) -> list:
        if self.alone:
            return [value]
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, value, group=self.group)
        return everyone

    def first(self, failure: OSError | None, lead_only: bool = False) -> OSError | None:
        """Every process's failure, agreed: the first rank's (the coordinator's, ``lead_only``)."""
        said = None if failure is None else (failure.errno, failure.strerror, failure.filename)
        everyone = self.gather(said)
        for other in everyone[:1] if lead_only else everyone:
            if other is not None:
                return OSError(*other)
        return None


__all__ = ["begin_folder", "end_folder", "os_error", "own_files", "write_folder"]
