"""Checkpoints written in the background: the step stalls only while the state is handed over.

A synchronous save (``runtime.checkpoint.save_checkpoint``) holds every process for the whole
write: copying the state off the device, writing every byte, hashing it. ``AsyncCheckpointer``
stages the state as torchtitan's ``checkpoint.async_mode = "async_with_pinned_mem"`` does with
``torch.distributed.checkpoint``: ``dcp.async_save`` with DCP's ``DefaultStager``, which copies
the state into CPU memory on a thread of its own (page-locked memory and a side CUDA stream
where the state is on a GPU, the copies kept between saves), then writes it on DCP's upload
thread, or from DCP's checkpoint process with ``writer="process"`` (torchtitan's choice; the
copies then in shared memory, handed over rather than pickled). Measured on a GPU, the two stall
training alike (docs/resilience.md links the results), so the thread, with no second process
to start and watch, is the default. The training thread returns from ``save`` as soon as the
copy is under way:

* **The copy is exact.** The state changes at the optimizer's step, so a hook on the optimizer
  (``register_step_pre_hook``) waits for the copy to end before its next step; the forward and
  backward between overlap it. Buffers (which a forward may update) are cloned on the training
  thread first, and anything else that writes the parameters calls ``wait_staged`` first.
* **Collectives of its own.** DCP's planning and the checkpoint's completion (each process
  hashes its files, the coordinator writes ``SHA256SUMS`` and the ``COMPLETE`` marker, then
  renames the folder: ``runtime.checkpoint_write.end_folder``) run on background threads while
  the training thread talks to its peers; they use a gloo group made for them
  (torchtitan's ``async_mode = "async"`` does the same), so the two never interleave on one
  communicator.
* **One at a time.** A save waits for the previous one first (DCP's staged copies are reused,
  and a run's checkpoints complete in step order); ``wait`` waits for the last one and raises
  its failure (a full disk: the ``OSError`` on every process, the unfinished folder removed),
  which the next ``save`` or ``close`` does too.
* **Killed mid-write.** Until the coordinator renames it, the checkpoint is a ``.partial``
  folder without its marker (``runtime.checkpoint_disk``): never loaded, removed by the next
  save to the same path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipetrain.runtime import checkpoint_disk, checkpoint_write
from pipetrain.runtime.checkpoint import (
    MODEL,
    checkpoint_processes,
    modules_of,
    saved_state,
)

#: who writes a save: a thread of this process, or DCP's checkpoint process
WRITERS = ("thread", "process")


class AsyncCheckpointer:
    """Writes checkpoints of the same processes in the background, one at a time (every process
    of a checkpoint makes one and calls it alike). ``timeout``: how long its process group
    waits on a peer (None: the default group's)."""

    def __init__(self, timeout: timedelta | None = None, writer: str = "thread") -> None:
        if writer not in WRITERS:
            raise ValueError(f"writer must be one of {', '.join(WRITERS)}, got {writer!r}")
        self.timeout = timeout
        self.writer = writer
        self._groups: dict[tuple[int, ...], Any] = {}
        self._stager: Any = None
        self._stager_shared = False
        self._hooks: dict[int, Any] = {}
        self._staging: Future | None = None
        self._thread: threading.Thread | None = None
        self._outcome: Path | BaseException | None = None

    def save(
        self,
        path: str | os.PathLike,
        target,
        optimizer=None,
        *,
        files: Mapping[str, str | bytes] | None = None,
        then: Callable[[Path], None] | None = None,
    ) -> None:
        """Start writing ``target``'s (a ``Pipeline`` or a module) and ``optimizer``'s state to
        ``path``, as ``save_checkpoint`` would (``files`` and ``then`` alike: ``then(path)`` on
        the coordinator once the folder is published), and return once the copy is under way.
        Waits for the previous save first, raising its failure. Collective."""
        import torch.distributed.checkpoint as dcp

        self.wait()
        final = Path(path)
        processes = checkpoint_processes(target)
        state = saved_state(target, optimizer)
        _clone_buffers(state, modules_of(target))
        own = self._processes(processes)
        if optimizer is not None and id(optimizer) not in self._hooks:
            self._hooks[id(optimizer)] = optimizer.register_step_pre_hook(self._before_step)
        partial = checkpoint_write.begin_folder(final, own)
        if _on_cuda(state):
            # DCP's stager copies on a stream of its own, ordered after nothing: the work
            # queued on the device (the last optimizer step) must be done before it reads
            torch.cuda.synchronize()
        upload: Future | None = None
        failure: BaseException | None = None
        try:
            process = self._in_process(own)
            response = dcp.async_save(
                state,
                checkpoint_id=partial,
                async_stager=self._stager_for(state, process),
                async_checkpointer_type=_checkpointer_type(process),
                **own,
            )
            if isinstance(response, Future):  # staged before it returned
                upload = response
            else:
                self._staging, upload = response.staging_completion, response.upload_completion
        except BaseException as e:  # handed to the completion, which agrees on it
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            failure = e
        self._outcome = None
        self._thread = threading.Thread(
            target=self._complete,
            args=(final, own, upload, failure, files, then),
            name="pipetrain-checkpoint",
            daemon=True,
        )
        self._thread.start()

    def wait_staged(self) -> None:
        """Return once the last save's copy of the state is taken (its write may go on)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            try:
                staging.result()
            except Exception:  # the write fails with it: ``wait`` raises that
                pass

    def wait(self) -> Path | None:
        """Wait for the last save to be complete (marked, published, ``then`` called): its
        path, or None when none is pending; its ``OSError`` where it failed (on every
        process alike)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return None
        thread.join()
        self._staging = None
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @property
    def pending(self) -> bool:
        """Whether a save was started and not yet waited for."""
        return self._thread is not None

    @property
    def writing(self) -> bool:
        """Whether the last save is still being written (``wait`` would block)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Wait for the last save (raising its failure), then let the copies, the optimizer
        hooks and the process groups go."""
        try:
            self.wait()
        finally:
            for handle in self._hooks.values():
                handle.remove()
            self._hooks.clear()
            if self._stager is not None:
                _close_stager(self._stager)
                self._stager = None
            for group in self._groups.values():
                dist.destroy_process_group(group)
            self._groups.clear()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _before_step(self, *_: object) -> None:
        self.wait_staged()

    def _complete(
        self,
        final: Path,
        processes: dict,
        upload: Future | None,
        failure: BaseException | None,
        files: Mapping[str, str | bytes] | None,
        then: Callable[[Path], None] | None,
    ) -> None:
        """The background half: DCP's upload waited for, then the folder completed by
        ``end_folder`` (agreed over the checkpoint's own group)."""
        partial = checkpoint_disk.partial_path(final)
        try:
            if upload is not None:
                try:
                    upload.result()
                except BaseException as e:
                    failure = e
            said = None if failure is None else checkpoint_write.os_error(failure, partial)
            checkpoint_write.end_folder(final, processes, said, files, then)
            self._outcome = final
        except BaseException as e:
            self._outcome = e

    def _processes(self, processes: dict) -> dict:
        """DCP's arguments for the background writes: alone, or a gloo group of the same
        processes made for them (once; only its members take part in making it)."""
        if processes.get("no_dist"):
            return {"no_dist": True}
        group = processes["process_group"]
        ranks = tuple(
            dist.get_process_group_ranks(group)
            if group is not None
            else range(dist.get_world_size())
        )
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(
                list(ranks), timeout=self.timeout, backend="gloo", use_local_synchronization=True
            )
        return {"process_group": self._groups[ranks]}

    def _in_process(self, own: dict) -> bool:
        """Whether DCP writes this save from its checkpoint process: as ``writer`` says, where
        there is a process group (the checkpoint process starts its own from it)."""
        return self.writer == "process" and not own.get("no_dist")

    def _stager_for(self, state: dict[str, object], shared: bool) -> Any:
        """DCP's stager: copies on its own thread, into page-locked memory from a side stream
        where the state is on a GPU (torchtitan's ``async_with_pinned_mem``), into shared
        memory where DCP's checkpoint process writes it (``shared``: the copies are handed to
        it, not pickled); kept between saves, as are its copies, where this torch's stager can
        stage again (``_stager_reusable``; otherwise a new one per save)."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is not None and (
            not _stager_reusable(self._stager) or self._stager_shared != shared
        ):
            _close_stager(self._stager)
            self._stager = None
        if self._stager is None:
            cuda = _on_cuda(state)
            self._stager_shared = shared
            self._stager = _keeping_copies(
                DefaultStager(
                    StagingOptions(
                        use_pinned_memory=cuda,
                        use_shared_memory=shared,
                        use_async_staging=True,
                        use_non_blocking_copy=cuda,
                    )
                )
            )
        return self._stager


def _stager_reusable(stager: object) -> bool:
    """Whether DCP's ``DefaultStager`` can stage again after a save. torch 2.11 closes the
    stager's internal deep-copier at the end of every staging (pytorch/pytorch#183413, fixed by
    #183424), emptying the dispatch table the next copy needs, which then fails with
    ``KeyError: <class 'type'>``; a stager whose table is empty is replaced before the next save."""
    inner = getattr(stager, "_state_dict_stager", None)
    table = getattr(inner, "_deepcopy_dispatch", None)
    return table is None or bool(table)


def _keeping_copies(stager: Any) -> Any:
    """``stager``, its copies kept from one save to the next. torch 2.11's ``DefaultStager``
    closes its inner copier after every staging (pytorch/pytorch#183413), which drops the
    page-locked copies, so each save would allocate and pin the whole state again while training
    goes on. The inner copier's ``close`` is a no-op until ``_close_stager`` (where this torch
    does not call it, nothing changes)."""
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None and callable(getattr(inner, "close", None)):
        inner.close = lambda: None
    return stager


def _close_stager(stager: Any) -> None:
    """Close a stager made by ``_keeping_copies``, its copies let go."""
    inner = getattr(stager, "_state_dict_stager", None)
    if inner is not None:
        vars(inner).pop("close", None)
    stager.close()
    if inner is not None:
        inner.close()


def _checkpointer_type(process: bool) -> Any:
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    return AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD


def _on_cuda(state: dict[str, object]) -> bool:
    return any(isinstance(v, torch.Tensor) and v.device.type == "cuda" for v in state.values())


def _clone_buffers(state: dict[str, object], modules: list) -> None:
    """Replace the buffers in ``state`` by copies taken now: a forward may update a buffer
    (running statistics) before the background copy reads it; parameters change only at the
    optimizer's step, which waits for the copy."""
    buffers = {name for module in modules for name, _ in module.named_buffers()}
    for name in buffers:
        key = MODEL + name
        value = state.get(key)
        if isinstance(value, torch.Tensor):
            state[key] = value.detach().clone()


__all__ = ["WRITERS", "AsyncCheckpointer"]
