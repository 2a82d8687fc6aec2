"""One writer per folder (``app.folder_lock``): a lock another process holds is refused naming
its host and pid, by the launcher's checks too (before any worker starts); where ``flock`` does
not work, a lock whose process is gone is taken over and a live one is refused."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipetrain.app import folder_lock
from pipetrain.app.folder_lock import FolderLock, lock_file, sibling_lock_file

HOLD = """
import sys, time
from pathlib import Path
from pipetrain.app.folder_lock import FolderLock
lock = FolderLock(Path(sys.argv[1]), "test")
lock.take()
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder_of(tmp_path: Path):
    """Start a process that holds the lock ``path``; it is stopped at the end."""
    started: list[subprocess.Popen] = []

    def start(path: Path) -> subprocess.Popen:
        path.parent.mkdir(parents=True, exist_ok=True)
        child = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
        )
        started.append(child)
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        return child

    yield start
    for child in started:
        child.kill()
        child.wait()


def test_a_held_lock_is_refused_naming_the_holder_then_free_once_it_ends(
    tmp_path: Path, holder_of
) -> None:
    path = lock_file(tmp_path / "ckpt")
    child = holder_of(path)
    with pytest.raises(ValueError, match=rf"host {socket.gethostname()}, pid {child.pid}, since"):
        FolderLock(path, "--checkpoint-dir x").take()
    child.kill()
    child.wait()
    with FolderLock(path, "--checkpoint-dir x") as lock:  # the kernel dropped the dead one's
        assert json.loads(path.read_text())["pid"] == os.getpid() and lock.held
    assert path.read_text() == ""  # released: no pid left behind


def test_the_launcher_refuses_a_second_run_before_any_worker(
    tmp_path: Path, holder_of, monkeypatch, capsys
) -> None:
    from pipetrain.app import launch
    from pipetrain.cli.commands import main

    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "start_processes", started)
    ckpt = tmp_path / "ckpt"
    child = holder_of(lock_file(ckpt))
    base = [
        "train",
        "--model",
        "gpt",
        "--steps",
        "1",
        "--layers",
        "2",
        "--corpus-out",
        str(tmp_path / "c.txt"),
    ]
    assert main([*base, "--checkpoint-dir", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--checkpoint-dir {ckpt} is being written by another run" in err, err
    assert f"pid {child.pid}" in err and "\n" not in err


def test_where_flock_fails_the_pid_inside_decides(tmp_path: Path, holder_of, monkeypatch) -> None:
    def no_flock(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    live = holder_of(tmp_path / "live.lock")  # a live process to name in the file
    monkeypatch.setattr(folder_lock.fcntl, "flock", no_flock)
    path = tmp_path / "held.lock"
    for pid, refused in ((live.pid, True), (2**22 + 12345, False)):  # the second: no such pid
        path.write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "t"}))
        lock = FolderLock(path, "--export out")
        if refused:
            with pytest.raises(ValueError, match=f"pid {pid}"):
                lock.take()
        else:
            lock.take()  # taken over from the process that is gone
            assert json.loads(path.read_text())["pid"] == os.getpid()
            lock.release()


def test_an_export_folder_locks_beside_itself(tmp_path: Path) -> None:
    assert sibling_lock_file(tmp_path / "out") == tmp_path / ".out.lock"
