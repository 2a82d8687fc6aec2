"""The rules of restarts and SIGTERM, without processes: when a started worker resumes (only a
restart, only from a checkpoint this job may resume), the flag checks, the launcher's exit status
after a stop, and the SIGTERM note agreed on once per step (a one-process group)."""

from __future__ import annotations

import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest

from pipetrain.app.config import TrainConfig
from pipetrain.app.processes import Ended
from pipetrain.app.restart import (
    check_restarts,
    restart_count,
    resume_on_restart,
    shared_store_warning,
)
from pipetrain.app.termination import TERMINATED, check_termination


def _saved(folder: Path, step: int) -> None:
    """What a complete save leaves for the restart rule: the step's folder and ``latest``."""
    (folder / f"step-{step:06d}").mkdir(parents=True)
    (folder / "latest").write_text(f"step-{step:06d}")


@pytest.mark.parametrize(
    ("environ", "count"),
    [
        ({}, 0),
        ({"TORCHELASTIC_RESTART_COUNT": "0"}, 0),
        ({"TORCHELASTIC_RESTART_COUNT": "2"}, 2),
        ({"SLURM_RESTART_COUNT": "1"}, 1),
        ({"SLURM_RESTART_COUNT": "3", "TORCHELASTIC_RESTART_COUNT": "1"}, 3),
        ({"SLURM_RESTART_COUNT": "x"}, 0),
    ],
)
def test_the_restart_count_is_torchruns_or_slurms(environ: dict[str, str], count: int) -> None:
    assert restart_count(environ) == count


def test_a_restart_resumes_from_the_latest_checkpoint_and_a_first_start_does_not(
    tmp_path: Path,
) -> None:
    config = TrainConfig(checkpoint_dir=str(tmp_path))
    assert resume_on_restart(config, 1) == config  # nothing saved yet: start over
    _saved(tmp_path, 10)
    assert resume_on_restart(config, 0) == config  # a first start keeps its checks
    resumed = resume_on_restart(config, 1)
    assert resumed.resume and resumed == TrainConfig(checkpoint_dir=str(tmp_path), resume=True)
    assert resume_on_restart(TrainConfig(), 3) == TrainConfig()  # no folder: nothing to resume


def test_a_partial_checkpoint_is_never_resumed(tmp_path: Path) -> None:
    """``latest`` moves only once a checkpoint is complete: a ``.partial`` folder alone (a
    worker killed while writing its first checkpoint) starts the run over."""
    (tmp_path / "step-000010.partial").mkdir()
    config = TrainConfig(checkpoint_dir=str(tmp_path))
    assert resume_on_restart(config, 1) == config


def test_an_overwriting_run_resumes_only_its_own_checkpoints(tmp_path: Path) -> None:
    """With ``--overwrite-checkpoints`` a checkpoint older than the agent (this test's parent
    process) is a previous run's, which this job replaces; a newer one is this job's."""
    _saved(tmp_path, 10)
    config = TrainConfig(checkpoint_dir=str(tmp_path), overwrite_checkpoints=True)
    resumed = resume_on_restart(config, 1)
    assert resumed.resume and not resumed.overwrite_checkpoints
    os.utime(tmp_path / "latest", (1.0, 1.0))  # written in 1970: before the agent started
    assert resume_on_restart(config, 1) == config


def test_checkpoint_on_term_needs_a_checkpoint_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--checkpoint-on-term .* give --checkpoint-dir DIR"):
        check_termination(TrainConfig(checkpoint_on_term=True))
    check_termination(TrainConfig(checkpoint_on_term=True, checkpoint_dir=str(tmp_path)))


def test_max_restarts_under_torchrun_is_torchruns_flag() -> None:
    with pytest.raises(ValueError, match="give torchrun --max-restarts N instead"):
        check_restarts(TrainConfig(max_restarts=2), under_torchrun=True)
    check_restarts(TrainConfig(max_restarts=2), under_torchrun=False)
    check_restarts(TrainConfig(), under_torchrun=True)


def test_the_flags_refuse_what_they_cannot_do() -> None:
    with pytest.raises(ValueError, match="--max-restarts must be >= 0"):
        TrainConfig(max_restarts=-1)
    with pytest.raises(ValueError, match="--term-grace must be > 0"):
        TrainConfig(term_grace=0.0)
    assert TrainConfig(max_restarts=0).max_restarts == 0


def test_torchruns_shared_store_with_restarts_is_warned_of() -> None:
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in shared_store_warning(shared)
    assert shared_store_warning(shared | {"TORCHELASTIC_USE_AGENT_STORE": "False"}) == ""
    assert shared_store_warning(shared | {"TORCHELASTIC_MAX_RESTARTS": "0"}) == ""


@pytest.mark.parametrize(
    ("ended", "status"),
    [
        # SIGTERM to the launcher, every worker stopped together after its checkpoint
        (Ended(0, signalled=signal.SIGTERM, codes=(TERMINATED, TERMINATED)), TERMINATED),
        # SIGTERM to the workers alone (Slurm signals every process of the step)
        (Ended(TERMINATED, rank=0, pid=1, codes=(TERMINATED, TERMINATED)), TERMINATED),
        # no --checkpoint-on-term: the workers died of it
        (Ended(0, signalled=signal.SIGTERM, codes=(-15, -15)), 128 + signal.SIGTERM),
        (Ended(0, signalled=signal.SIGINT, codes=(-15, -15)), 128 + signal.SIGINT),
        (Ended(0, codes=(0, 0)), 0),
    ],
)
def test_the_launchers_status_after_a_stop(ended: Ended, status: int) -> None:
    from pipetrain.app.launch import _outcome

    assert _outcome(ended, TrainConfig())[0] == status


@pytest.fixture
def one_process_group():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True)  # port 0: the store picks one
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(60))
    try:
        yield torch.device("cpu")
    finally:
        dist.destroy_process_group()


def test_sigterm_is_noted_and_agreed_on_at_the_step_end(one_process_group, tmp_path) -> None:
    from pipetrain.app.termination import Terminated, TermWatch

    before = signal.getsignal(signal.SIGTERM)
    config = TrainConfig(checkpoint_on_term=True, checkpoint_dir=str(tmp_path))
    with TermWatch(config, one_process_group) as watch:
        assert not watch.agreed()
        os.kill(os.getpid(), signal.SIGTERM)  # noted by the handler: the process lives on
        assert watch.agreed()
        stopped = watch.stopped(7, 30, tmp_path / "step-000007")
        assert isinstance(stopped, Terminated) and stopped.step == 7
        assert "stopped by SIGTERM after step 7 of 30" in str(stopped)
    assert signal.getsignal(signal.SIGTERM) == before
    off = TermWatch(TrainConfig(), one_process_group)  # without the flag: no handler, no vote
    assert signal.getsignal(signal.SIGTERM) == before and not off.agreed()


class _Failure:
    """What torch's agent records of a worker that ended (``ProcessFailure``'s fields read)."""

    def __init__(self, exitcode: int, pid: int) -> None:
        self.exitcode, self.pid, self.timestamp = exitcode, pid, 0


def test_the_first_failure_found_is_named_with_its_signal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The agent lists the worker it found dead before the ones it then stopped; once no restart
    is left the launcher names it and exits 1, or passes on a status no restart changes."""
    from pipetrain.app.restart import _failed

    _saved(tmp_path, 20)
    config = TrainConfig(checkpoint_dir=str(tmp_path), max_restarts=2)
    found = {1: _Failure(-signal.SIGKILL, 4242), 0: _Failure(-signal.SIGTERM, 4241)}
    assert _failed(config, found) == 1
    said = capsys.readouterr().err
    assert "rank 1 (pid 4242) killed by SIGKILL at " in said
    assert "no restart left (--max-restarts 2); latest checkpoint: " in said
    assert said.rstrip().endswith("step-000020")
    assert _failed(config, {0: _Failure(1, 7)}) == 1  # an exception: its traceback is above
    assert "rank 0 (pid 7) exited with status 1 at " in capsys.readouterr().err
    # found together: the peer that exited on the connection reset, and the one killed first
    assert _failed(config, {0: _Failure(1, 7), 1: _Failure(-signal.SIGKILL, 8)}) == 1
    assert "rank 1 (pid 8) killed by SIGKILL at " in capsys.readouterr().err
    assert _failed(config, {0: _Failure(1, 7)}) == 1
    assert "rank 0 (pid 7) exited with status 1 at " in capsys.readouterr().err
    for status in (2, TERMINATED):  # refused, or stopped on SIGTERM: the worker said so
        assert _failed(config, {0: _Failure(status, 1)}) == status
        assert capsys.readouterr().err == ""
