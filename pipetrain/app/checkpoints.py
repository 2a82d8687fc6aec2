"""``pipetrain train``'s checkpoint directory: one DCP checkpoint per saved step, and a pointer to
the latest.

    DIR/step-000040/       model and optimizer state by global name (pipetrain.save_checkpoint)
    DIR/step-000040/train.json   the step and the model's shape
    DIR/step-000040/hf/    copies of --model-dir's config and tokenizer files (pipetrain export)
    DIR/step-000040/SHA256SUMS   every file's SHA-256 (sha256sum -c format; pipetrain verify)
    DIR/step-000040/COMPLETE     written last: the checkpoint is whole (runtime.checkpoint_disk)
    DIR/latest             "step-000040", written once the whole checkpoint is on disk
    DIR/.lock              held by the run writing here (app.folder_lock)

A step's folder appears only once complete (``runtime.checkpoint_disk``: written as
``step-000040.partial``, marked ``COMPLETE``, then renamed), so a run stopped while saving (a
signal, a dead process, a background write cut short) leaves a ``.partial`` folder that
``--resume`` ignores, names and removes, never a half-written ``step-*``. With
``--async-checkpoint`` the write goes on in the background (``runtime.checkpoint_async``) while
training continues; ``latest`` moves, and ``--keep-checkpoints K`` removes the oldest complete
checkpoints beyond K, only once it is complete, and the next save (or the end of the run) waits
for it. Before any process starts (``check_directory``) the directory must be a writable
folder, and one that already holds checkpoints needs ``--resume`` (continue from them) or
``--overwrite-checkpoints`` (replace them: removed when this run writes its first one), so that a
new run never moves ``latest`` back to an older step among a previous run's checkpoints.

State is keyed by the model's global layer names (``runtime.checkpoint``), so a run may resume
at another pipeline size or schedule, and with or without data parallel (DDP or FSDP2, whose
replicas write their shards). Resuming checks the latest checkpoint's files and the model's shape
first and names the first problem, and the last complete checkpoint where the latest is corrupt.
Each process hashes the files it wrote, and ``SHA256SUMS`` is written before the folder is
published; resuming with ``verify`` (``--verify-checkpoint``) checks every file against it (each
process a share), so a shard damaged after it was written is refused naming the file and the last
checkpoint that verifies, instead of loading silently; ``pipetrain verify`` checks without
resuming. One run writes a directory at a time: the rank-0 process holds its lock
(``hold``), and the launcher's ``check_directory`` refuses a second run naming the first's host
and pid.

The step count is all the training loop needs besides: the data order is a function of the seed
and the step, and AdamW's state (its step included) is in the checkpoint — so a run resumed on
the same layout continues bit for bit. On another layout it continues to float64 round-off only:
the layout decides which stages accumulate a linear's weight gradient inside the GEMM and which
add it after, and a BLAS may round the two differently (docs/training.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from pipetrain.app.catalog import ModelShape
from pipetrain.app.folder_lock import FolderLock, check_free, hold_on_rank0, lock_file
from pipetrain.runtime import checksums
from pipetrain.runtime.checkpoint_disk import COMPLETE, PARTIAL, remove

LATEST = "latest"
INFO = "train.json"
#: the subfolder holding copies of the model folder's config and tokenizer files
FOLDER_COPIES = "hf"
#: the files of a Hugging Face folder besides its weights that an export needs
FOLDER_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
_STEP = re.compile(r"step-(\d+)(\.partial)?")
#: fields of the shape a checkpoint must share with the run resuming it (the seed only orders
#: the data and initialises weights the checkpoint replaces)
_MUST_MATCH = tuple(f.name for f in dataclasses.fields(ModelShape) if f.name != "seed")


class Checkpoints:
    """Save and resume under one directory (every process of the run calls both).

    ``overwrite``: the first save removes the checkpoints already there (``--overwrite-
    checkpoints``). ``asynchronous``: saves are written in the background
    (``runtime.checkpoint_async``; ``--async-checkpoint``), each complete before the next
    starts and the last waited for on leaving the ``with`` block (or ``wait``). ``keep``: once
    a save is complete, the oldest complete checkpoints beyond ``keep`` are removed
    (``--keep-checkpoints``; None keeps all). ``timeout``: how long the background writes wait
    on a peer."""

    def __init__(
        self,
        directory: str | os.PathLike,
        shape: ModelShape,
        overwrite: bool = False,
        verify: bool = False,
        *,
        asynchronous: bool = False,
        keep: int | None = None,
        timeout: float | None = None,
    ) -> None:
        if keep is not None and keep < 1:
            raise ValueError(f"--keep-checkpoints must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.shape = shape
        self.overwrite = overwrite
        #: check the resumed checkpoint's files against its SHA256SUMS (``--verify-checkpoint``:
        #: it adds about 40% to loading, docs/results/cpu-2026-12-02-checkpoint-verify)
        self.verify = verify
        self.asynchronous = asynchronous
        self.keep = keep
        self.timeout = timeout
        self._lock = FolderLock(lock_file(self.directory), f"--checkpoint-dir {self.directory}")
        self._holding = False
        self._writer: Any = None  # runtime.checkpoint_async.AsyncCheckpointer, made at need

    def hold(self) -> None:
        """Lock the directory for this run (``app.folder_lock``): the rank-0 process takes the
        lock and keeps it until it exits. Collective (``save`` and ``resume`` call it first):
        where another run holds it, every process raises the ``ValueError`` naming that run.
        Call it once the process group is up, before training, so that a second run is
        refused before either writes."""
        if not self._holding:
            hold_on_rank0(self._lock)
        self._holding = True

    def release(self) -> None:
        """Let the directory's lock go (the end of the run; a process's exit lets it go too)."""
        self._lock.release()
        self._holding = False

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, kind: object, error: object, trace: object) -> None:
        """Wait for a save still being written, then let the lock go. Its failure is raised
        when nothing else is; while another error leaves the run, it is printed instead."""
        try:
            self.close_writer()
        except Exception as e:
            if error is None:
                raise
            print(f"pipetrain train: the checkpoint being written failed too: {e}", flush=True)
        finally:
            self.release()

    def save(self, step: int, pipe, optimizer) -> Path:
        """Write step ``step``: every process writes its part (with data parallel, each DDP
        replica offers the same tensors and DCP writes them once; each FSDP2 replica its shards).
        Collective. Synchronous: returns on every process once the checkpoint is complete and
        ``latest`` names it (a process that went on before the pointer moved would find the
        previous one, or none: a resume right after a save read no checkpoint on one rank and
        left the others waiting for it). Asynchronous: waits for the previous save (raising
        its failure), returns once the state is being copied; ``latest`` moves when it is
        complete.
        """
        import torch.distributed as dist

        self.hold()
        if self._writer is not None:
            self._writer.wait()  # before the overwrite below: the last save is complete
        lead = dist.get_rank() == 0
        if self.overwrite and lead:  # the save's first barrier orders this before it
            for path in checkpoint_folders(self.directory):
                remove(path)
            remove(self.directory / LATEST)
        self.overwrite = False
        path = self.directory / f"step-{step:06d}"
        info = {"step": step, "model": dataclasses.asdict(self.shape)}
        files: dict[str, str | bytes] = {INFO: json.dumps(info, indent=1) + "\n"}
        if lead:
            files.update(folder_copies(pipe))
        if self.asynchronous:
            self._async_writer().save(path, pipe, optimizer, files=files, then=self._published)
        else:
            from pipetrain.runtime.checkpoint import save_checkpoint

            save_checkpoint(path, pipe, optimizer, files=files, then=self._published)
        return path

    def wait(self) -> Path | None:
        """Wait for the checkpoint being written in the background, if any: its folder (None
        when there is none); its ``OSError`` on every process where it failed."""
        return None if self._writer is None else self._writer.wait()

    def close_writer(self) -> None:
        """``wait``, then let the background writer's copies and process group go."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    def _async_writer(self) -> Any:
        if self._writer is None:
            from datetime import timedelta

            from pipetrain.runtime.checkpoint_async import AsyncCheckpointer

            wait = None if self.timeout is None else timedelta(seconds=self.timeout)
            self._writer = AsyncCheckpointer(timeout=wait)
        return self._writer

    def _published(self, path: Path) -> None:
        """On the coordinator, once ``path`` is complete under its name: ``latest`` moves to it,
        then ``keep`` prunes the oldest."""
        tmp = self.directory / f"{LATEST}.tmp"
        tmp.write_text(path.name + "\n")
        tmp.replace(self.directory / LATEST)
        if self.keep is not None:
            prune(self.directory, self.keep, path)

    def latest(self) -> tuple[Path, int]:
        """The latest checkpoint's directory and step, its files checked; ``ValueError`` when
        there is none, it is incomplete or corrupt (naming the last complete one), or it is of
        another model."""
        pointer = self.directory / LATEST
        if not pointer.is_file():
            raise ValueError(
                f"no checkpoint to resume from in {self.directory} (no {LATEST!r} file); "
                "run without --resume first, with --checkpoint-dir"
            )
        path = self.directory / pointer.read_text().strip()
        if not path.exists():  # removed by hand (it was corrupt): the newest complete one
            path = latest_complete(self.directory) or path
        try:
            step = checked_step(path)
        except ValueError as e:
            raise ValueError(f"{e}; {_fallback(self.directory, path)}") from None
        saved = json.loads((path / INFO).read_text()).get("model", {})
        for name in _MUST_MATCH:
            if saved.get(name) != getattr(self.shape, name):
                flag = "--" + {"blocks": "layers"}.get(name, name).replace("_", "-")
                raise ValueError(
                    f"checkpoint {path} is of another model: {flag} {saved.get(name)} there, "
                    f"{getattr(self.shape, name)} here; resume with the same model flags"
                )
        return path, step

    def resume(self, pipe, optimizer) -> int:
        """Load the latest checkpoint into ``pipe`` and ``optimizer``; the step it was saved at.
        A refusal (``ValueError``) names the checkpoint and the last complete one; nothing of
        the pipeline or the optimizer changed then."""
        from pipetrain.runtime.checkpoint import load_checkpoint

        self.hold()
        path, step = self._agreed_latest()
        try:
            load_checkpoint(path, pipe, optimizer, verify=self.verify)
        except (KeyError, ValueError) as e:
            message = str(e.args[0]) if e.args else str(e)
            raise ValueError(f"{message}; {_fallback(self.directory, path)}") from None
        if _is_lead():  # the lock's holder: no other run writes here
            for partial in checkpoint_folders(self.directory):
                if partial.name.endswith(PARTIAL):
                    remove(partial)
                    print(
                        f"removed {partial}: an incomplete checkpoint (a run stopped while "
                        "writing it)",
                        flush=True,
                    )
        return step

    def _agreed_latest(self) -> tuple[Path, int]:
        """``latest()`` on every process, agreed before the collective load: a process that
        cannot resume (its disk lacks the checkpoint, holds a corrupt or another one) refuses
        on every process, named, instead of leaving the others in the load until the timeout;
        processes that found different checkpoints refuse too."""
        import torch.distributed as dist

        try:
            path, step = self.latest()
            mine: tuple = (None, str(path), step)
        except ValueError as e:
            mine = (str(e), "", -1)
        if not dist.is_initialized() or dist.get_world_size() == 1:
            if mine[0] is not None:
                raise ValueError(mine[0])
            return path, step
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        me = dist.get_rank()
        for rank, (refusal, _, _) in enumerate(everyone):
            if refusal is not None:
                raise ValueError(refusal if rank == me else f"rank {rank}: {refusal}")
        found = {(name, at) for _, name, at in everyone}
        if len(found) > 1:
            seen = ", ".join(
                f"rank {r}: {name} (step {at})" for r, (_, name, at) in enumerate(everyone)
            )
            raise ValueError(
                f"the processes found different checkpoints to resume from ({seen}); every "
                "process must see the same --checkpoint-dir"
            )
        return path, step


def prune(directory: Path, keep: int, newest: Path) -> list[Path]:
    """Remove the oldest complete checkpoints in ``directory`` beyond ``keep``, never ``newest``
    (the one just completed): what was removed. Folders still being written (``.partial``) and
    folders without their ``COMPLETE`` marker are not counted and left alone."""
    complete = [
        p
        for p in checkpoint_folders(directory)
        if not p.name.endswith(PARTIAL) and (p / COMPLETE).is_file() and p != newest
    ]
    gone = complete[: max(0, len(complete) - (keep - 1))]
    for path in gone:
        remove(path)  # its marker first: a removal cut short leaves an incomplete folder
    return gone


def _is_lead() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def checked_step(path: Path, hashes: bool = False) -> int:
    """A complete checkpoint's step (its ``train.json`` and DCP files checked; with ``hashes``,
    every file against its ``SHA256SUMS`` too), or ``ValueError`` naming what is wrong."""
    from pipetrain.runtime.checkpoint_disk import verify

    try:
        info = json.loads((path / INFO).read_text())
        step = int(info["step"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"checkpoint {path} is incomplete: {path / INFO} cannot be read ({e})"
        ) from None
    verify(path)
    if hashes:
        try:
            checksums.verify(path)
        except ValueError as e:
            raise ValueError(f"checkpoint {path} is damaged: {e}") from None
    return step


def folder_copies(pipe) -> dict[str, bytes]:
    """The model folder's files besides its weights (config, generation config, tokenizer) that
    a checkpoint keeps under ``hf/``, read from the folder this process's stages were loaded
    from (``Stage.hf_folder``; none for a model built in memory), so that ``pipetrain export``
    needs the checkpoint alone."""
    folders = [getattr(m, "hf_folder", None) for m in getattr(pipe, "modules", {}).values()]
    source = next((Path(f) for f in folders if f is not None), None)
    if source is None:
        return {}
    return {
        f"{FOLDER_COPIES}/{name}": (source / name).read_bytes()
        for name in FOLDER_FILES
        if (source / name).is_file()
    }


def checkpoint_folders(directory: str | os.PathLike) -> list[Path]:
    """Every ``step-*`` folder in ``directory``, complete or not (``.partial``), in step order."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = {p: m for p in folder.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()}
    return sorted(found, key=lambda p: (int(found[p].group(1)), p.name))


def latest_pointer(directory: str | os.PathLike) -> Path | None:
    """The checkpoint ``DIR/latest`` names (written only once it was complete), or None."""
    try:
        name = (Path(directory) / LATEST).read_text().strip()
    except OSError:
        return None
    return Path(directory) / name if name else None


def latest_complete(directory: str | os.PathLike, before: Path | None = None) -> Path | None:
    """The newest checkpoint in ``directory`` whose files are all there and verify against its
    ``SHA256SUMS`` (older than ``before`` when given), or None."""
    for path in reversed(checkpoint_folders(directory)):
        if path.name.endswith(PARTIAL) or path == before:
            continue
        try:
            checked_step(path, hashes=True)
        except ValueError:
            continue
        return path
    return None


def _fallback(directory: Path, broken: Path) -> str:
    """What to do when ``broken`` cannot be resumed from."""
    good = latest_complete(directory, before=broken)
    if good is None:
        return f"{directory} holds no complete checkpoint to resume from"
    return (
        f"the last complete checkpoint in {directory} is {good.name} (remove {broken.name} to "
        "resume from it)"
    )


def incomplete_checkpoints(config) -> list[Path]:
    """The ``.partial`` folders a ``--resume`` run ignores (runs stopped while writing them)."""
    if config.checkpoint_dir is None or not config.resume:
        return []
    return [p for p in checkpoint_folders(config.checkpoint_dir) if p.name.endswith(PARTIAL)]


def _lock_is_ours_to_check() -> bool:
    """Whether this process probes the folder's lock: the launcher (no process group yet) or
    the job's rank 0, which takes the lock. Ranks of a job that calls ``train`` again in the same
    processes may reach the next run's checks before rank 0 has let the last run's lock go."""
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist is None or not dist.is_initialized() or dist.get_rank() == 0


def check_directory(config) -> None:
    """Before any process starts: ``--checkpoint-dir`` is a writable folder (made if missing),
    and one holding checkpoints is resumed from or overwritten on purpose; ``ValueError``
    naming the flags otherwise."""
    if config.checkpoint_dir is None:
        for name in ("overwrite_checkpoints", "async_checkpoint", "keep_checkpoints"):
            if getattr(config, name) not in (None, False):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} needs --checkpoint-dir DIR")
        return
    flag = f"--checkpoint-dir {config.checkpoint_dir}"
    if config.resume and config.overwrite_checkpoints:
        raise ValueError(
            "--resume continues from the checkpoints in --checkpoint-dir and "
            "--overwrite-checkpoints replaces them: give one of them"
        )
    folder = Path(config.checkpoint_dir)
    make_writable_folder(folder, flag)
    if _lock_is_ours_to_check():
        check_free(lock_file(folder), flag)
    if config.resume or config.overwrite_checkpoints:
        return
    held = [p for p in checkpoint_folders(folder) if not p.name.endswith(PARTIAL)]
    if held or (folder / LATEST).exists():
        newest = f" (up to {held[-1].name})" if held else ""
        raise ValueError(
            f"{flag} holds checkpoints{newest}; continue from them with --resume, or replace "
            "them with --overwrite-checkpoints"
        )


def make_writable_folder(folder: Path, flag: str) -> None:
    """Make ``folder`` (the value of ``flag``) if missing and check that a file can be written in
    it, or raise a one-line ``ValueError`` naming the flag."""
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{flag} is a file, not a folder; name a folder (made if missing)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # permissions alone say nothing as root
            pass
    except OSError as e:
        raise ValueError(f"{flag} is not a writable folder ({e.strerror or e})") from None


__all__ = [
    "FOLDER_COPIES",
    "FOLDER_FILES",
    "INFO",
    "LATEST",
    "Checkpoints",
    "check_directory",
    "checked_step",
    "checkpoint_folders",
    "folder_copies",
    "incomplete_checkpoints",
    "latest_complete",
    "latest_pointer",
    "make_writable_folder",
    "prune",
]
