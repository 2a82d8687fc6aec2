"""A ``pipetrain train`` worker that fails reads as one cause: a checkpoint write past the file-size
limit (``prlimit --fsize``: Python ignores SIGXFSZ, so the write raises ``OSError`` EFBIG, as a
full disk raises ENOSPC) stops every worker, each traceback goes to ``<checkpoint dir>/logs``,
and the launcher prints one line naming the errno, the latest good checkpoint and the logs.
Also: the cause line of the errors a worker meets, in-process."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pipetrain.app.failure_logs import cause_of, clear_logs, read_cause, write_log

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16"]
TINY += ["-m", "2", "--microbatch-size", "2", "--timeout", "60", "--checkpoint-every", "1"]


def _train(folder: Path, *flags: str, limit: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pipetrain", "train", *TINY, *flags]
    cmd += ["--checkpoint-dir", str(folder / "ck"), "--svg", str(folder / "s.svg")]
    cmd += ["--corpus-out", str(folder / "corpus.txt")]
    if limit is not None:
        cmd = ["prlimit", f"--fsize={limit}", *cmd]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def full_disk(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One checkpointed step, then a resumed run whose next checkpoint write fails."""
    if shutil.which("prlimit") is None:
        pytest.fail("prlimit (util-linux) is needed to limit the file size")
    folder = tmp_path_factory.mktemp("full")
    first = _train(folder, "--steps", "1")
    assert first.returncode == 0, first.stderr
    # the corpus and the first checkpoint exist: only the next checkpoint's files are written
    return folder, _train(folder, "--steps", "3", "--resume", limit=50_000)


@pytest.mark.slow
def test_a_failed_checkpoint_write_is_one_line_naming_the_cause(full_disk) -> None:
    folder, done = full_disk
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # no traceback on the terminal
    ck = folder / "ck"
    assert lines[0].startswith("pipetrain train: error: rank "), lines
    assert "EFBIG" in lines[0], lines
    assert f"latest good checkpoint: {ck / 'step-000001'}" in lines[0], lines
    assert f"logs: {ck / 'logs'}/" in lines[0], lines
    for rank in (0, 1):
        log = (ck / "logs" / f"rank-{rank}.log").read_text()
        assert log.startswith(("cause: ", "heard: ")) and "Traceback" in log, log


@pytest.mark.slow
def test_a_failed_checkpoint_write_leaves_no_partial_folder(full_disk) -> None:
    folder, done = full_disk
    assert done.returncode == 1, done.stderr
    assert not list((folder / "ck").glob("*.partial")), sorted((folder / "ck").iterdir())


def test_an_os_error_is_named_by_errno_and_path_wherever_it_is_in_the_chain(tmp_path) -> None:
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "a" / "b"))
    full.needed_bytes = 4096  # type: ignore[attr-defined]
    said = cause_of(full)
    assert said.startswith(f"OSError ENOSPC (No space left on device): {tmp_path / 'a' / 'b'}")
    assert "4,096 bytes needed" in said and "bytes free there" in said
    try:
        try:
            raise OSError(errno.EFBIG, "File too large")
        except OSError as inner:
            raise RuntimeError("writing the checkpoint failed") from inner
    except RuntimeError as outer:
        assert cause_of(outer) == "OSError EFBIG (File too large)"

    class Collected(BaseException):  # as torch.distributed.checkpoint's CheckpointException
        def __init__(self, message: str, failures: dict) -> None:
            super().__init__(message)
            self.failures = failures

    denied = {1: (PermissionError(errno.EACCES, "Permission denied", "/x"), None)}
    assert cause_of(Collected("two ranks failed\nTraceback...", denied)) == (
        "PermissionError EACCES (Permission denied): /x"
    )
    assert cause_of(ValueError("bad\nmore")) == "ValueError: bad"


def test_the_launcher_reports_the_rank_that_failed_on_its_own(tmp_path) -> None:
    from pipetrain.runtime.comm.failures import PeerFailedError

    logs = tmp_path / "logs"
    assert read_cause(logs) is None
    heard = PeerFailedError("rank 0 stopped: rank 2 failed: boom")
    heard.origin, heard.notice = 2, "boom"
    assert write_log(logs, 0, heard)
    assert read_cause(logs) == (0, "PeerFailedError: rank 0 stopped: rank 2 failed: boom")
    assert write_log(logs, 2, RuntimeError("boom"))
    assert read_cause(logs) == (2, "RuntimeError: boom")
    (logs / "notes.txt").write_text("kept")
    clear_logs(logs)
    assert sorted(p.name for p in logs.iterdir()) == ["notes.txt"]
