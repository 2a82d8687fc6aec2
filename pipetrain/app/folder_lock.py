"""One writer per folder: a run's checkpoint and export folders are locked while it writes them.

Two runs given one ``--checkpoint-dir`` would interleave their steps and move ``latest`` back
and forth, each resuming the other's state; nothing in the files says so. The rank-0 worker
holds ``fcntl.flock`` on ``DIR/.lock`` for the whole run (a lock the kernel drops when the
process dies, however it dies, so a restart of the same job takes it again), and writes its
host, pid and start time inside; the launcher checks it before any process starts, so a second
run is refused in one line naming the first's host and pid.

Where ``flock`` does not work (some network file systems refuse it), the file's contents decide:
a lock naming a live process on this host is held; one whose process is gone (on the same host)
is taken over. A lock written on another host cannot be checked from here and is held.

An export folder is renamed into place when complete (``app.model_folder``), so its lock is a
sibling file, ``.<name>.lock``, beside it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK = ".lock"
#: the errors of a file system without ``flock``
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
#: how long taking the lock waits for another process's check (which holds it for moments)
_CHECK_WAIT_S = 1.0


def lock_file(folder: Path) -> Path:
    """A checkpoint folder's lock: inside it."""
    return folder / LOCK


def sibling_lock_file(folder: Path) -> Path:
    """A folder renamed into place (an export): its lock beside it."""
    return folder.with_name(f".{folder.name}.lock")


class FolderLock:
    """The lock of one folder (``path`` its lock file; ``what`` names the folder, a flag and its
    value, in refusals). Taken with ``take``, held until ``release`` or the process's end."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self) -> None:
        """Take the lock (again taking it is nothing); a ``ValueError`` naming the run holding
        it."""
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _flock_soon(fd)
        except BlockingIOError:
            found = holder(self.path)
            if not _this_process(found):  # this process holds it through another handle
                os.close(fd)
                raise ValueError(self._refusal(found)) from None
        except OSError as e:
            if e.errno not in _NO_FLOCK:
                os.close(fd)
                raise
            found = holder(self.path)  # no flock here: the pid written inside decides
            if found is not None and _alive(found) and not _this_process(found):
                os.close(fd)
                raise ValueError(self._refusal(found)) from None
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Drop the lock; its file is emptied first, so that where ``flock`` does not work no
        pid is left behind to refuse the next run (a holder that dies leaves its pid)."""
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)

    def __enter__(self) -> FolderLock:
        self.take()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _refusal(self, found: dict | None) -> str:
        who = (
            f"host {found.get('host')}, pid {found.get('pid')}, since {found.get('started')}"
            if found
            else "its host and pid unknown"
        )
        return (
            f"{self.what} is being written by another run ({who}; lock {self.path}); wait for "
            "it to end or stop it, or give another folder"
        )


def hold_on_rank0(lock: FolderLock) -> None:
    """Take ``lock`` on the job's rank 0, agreed: where another run holds it, every process
    raises the ``ValueError`` naming that run (none is left waiting in a later collective)."""
    import torch.distributed as dist

    refusal = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            lock.take()
        except ValueError as e:
            refusal = str(e)
        except OSError as e:
            refusal = f"{lock.what} cannot be locked ({lock.path}: {e.strerror or e})"
    if dist.is_initialized() and dist.get_world_size() > 1:
        said = [refusal]
        dist.broadcast_object_list(said, src=0)
        refusal = said[0]
    if refusal is not None:
        raise ValueError(refusal)


def check_free(path: Path, what: str) -> None:
    """The launcher's check: ``ValueError`` naming the holder where another run holds the lock.
    A shared lock, taken and dropped at once, so that checks never refuse each other (the rank-0
    worker takes the exclusive one for the run). Nothing where the folder does not exist yet."""
    if not path.parent.is_dir():
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        found = holder(path)
        if not _this_process(found):
            raise ValueError(FolderLock(path, what)._refusal(found)) from None
    except OSError as e:  # no flock here: the pid written inside decides
        found = holder(path)
        if (
            e.errno in _NO_FLOCK
            and found is not None
            and _alive(found)
            and not _this_process(found)
        ):
            raise ValueError(FolderLock(path, what)._refusal(found)) from None
    finally:
        os.close(fd)


def _flock_soon(fd: int) -> None:
    """``flock`` the file exclusively, waiting a moment for checks that hold it shared (they
    drop it at once; a run holds it for its whole life): ``BlockingIOError`` after that."""
    deadline = time.monotonic() + _CHECK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def holder(path: Path) -> dict | None:
    """What the lock file says of its holder (host, pid, start), or None."""
    try:
        found = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _alive(found: dict) -> bool:
    """Whether the holder may be running: not provably gone (a pid on another host cannot be
    checked from here)."""
    if found.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(found.get("pid", -1)), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:
        return True
    return True


def _this_process(found: dict | None) -> bool:
    """Whether the lock file names this very process (it holds the lock through another
    handle)."""
    if found is None:
        return False
    return found.get("host") == socket.gethostname() and found.get("pid") == os.getpid()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


__all__ = [
    "LOCK",
    "FolderLock",
    "check_free",
    "hold_on_rank0",
    "holder",
    "lock_file",
    "sibling_lock_file",
]
