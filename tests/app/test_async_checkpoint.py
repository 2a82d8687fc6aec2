"""``--async-checkpoint`` and ``--keep-checkpoints``: a checkpoint written in the background holds
exactly the state of the step it was taken at (the optimizer's next step waits for the copy),
completes with its ``SHA256SUMS`` and ``COMPLETE`` marker before ``latest`` names it, fails on
every process alike, and a process killed in the middle of a background write resumes from the
last complete checkpoint, bit for bit (``tests/support/async_checkpoint_cases.py``)."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest
import torch
from runtime_harness import context, free_port, launch

from pipetrain.app.checkpoints import LATEST, prune
from pipetrain.runtime import checksums
from pipetrain.runtime.checkpoint import load_checkpoint, save_checkpoint
from pipetrain.runtime.checkpoint_async import AsyncCheckpointer
from pipetrain.runtime.checkpoint_disk import COMPLETE, PARTIAL


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)]
    return torch.nn.Sequential(*layers).double()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x = torch.randn(6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().mean().backward()  # a forward updates BatchNorm's running statistics
    opt.step()


def test_a_background_checkpoint_holds_the_state_of_its_step(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    taken = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in opt.state.values()]
    published: list[Path] = []
    with AsyncCheckpointer() as writer:
        writer.save(tmp_path / "step", model, opt, files={"note.txt": "hi"}, then=published.append)
        for seed in (1, 2, 3):  # these change every tensor while the write may go on
            _step(model, opt, seed)
        assert writer.pending and writer.wait() == tmp_path / "step"
        assert writer.wait() is None and not writer.pending
    assert published == [tmp_path / "step"]
    assert not any(
        torch.equal(taken[k], v) for k, v in model.state_dict().items() if v.is_floating_point()
    )
    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    load_checkpoint(tmp_path / "step", fresh, fresh_opt, verify=True)
    assert all(torch.equal(taken[k], v) for k, v in fresh.state_dict().items())
    assert all(torch.equal(a, s["exp_avg"]) for a, s in zip(moments, fresh_opt.state.values()))
    assert (tmp_path / "step" / COMPLETE).is_file() and (tmp_path / "step" / "note.txt").is_file()
    assert checksums.damaged(tmp_path / "step") == []
    assert COMPLETE in checksums.read_sums(tmp_path / "step")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]


def test_a_failed_background_write_raises_at_the_next_wait_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    (tmp_path / "file").write_text("not a folder")
    with AsyncCheckpointer() as writer:
        writer.save(tmp_path / "file" / "step", model, opt)
        _step(model, opt, 0)  # the optimizer's wait for the copy does not raise
        with pytest.raises(OSError) as e:
            writer.save(tmp_path / "step", model, opt)  # waits for the failed one first
        assert e.value.errno == errno.ENOTDIR and "file/step.partial" in str(e.value.filename)
        writer.save(tmp_path / "step", model, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "step"]


def test_keep_removes_the_oldest_complete_checkpoints_only(tmp_path: Path) -> None:
    for name in ("step-000002", "step-000004", "step-000006", "step-000010", "step-000008"):
        (tmp_path / name).mkdir()
        (tmp_path / name / COMPLETE).write_text("")
    (tmp_path / "step-000001").mkdir()  # no marker: not complete, not counted
    (tmp_path / f"step-000012{PARTIAL}").mkdir()  # being written: left alone
    # the one just completed is kept even where an older run left a later step
    gone = prune(tmp_path, 2, tmp_path / "step-000006")
    assert [p.name for p in gone] == ["step-000002", "step-000004", "step-000008"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["step-000001", "step-000006", "step-000010", f"step-000012{PARTIAL}"]
    assert prune(tmp_path, 1, tmp_path / "step-000010") == [tmp_path / "step-000006"]


def test_two_ranks_write_in_the_background_what_they_hold_without_changing_the_run(
    tmp_path: Path,
) -> None:
    for said in launch(2, _cases().background_against_none, str(tmp_path), timeout=120):
        plain, background = said["losses"]
        assert background == plain and len(plain) == 3 and said["final_equal"]
        assert said["held"] == {"step-000002": True, "step-000003": True}
    assert (tmp_path / "async" / LATEST).read_text().strip() == "step-000003"
    assert not any(p.name.startswith("step-") for p in (tmp_path / "none").iterdir())


def test_a_run_killed_during_a_background_write_resumes_from_the_last_complete_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "ckpt"
    assert _run_alone(_args(ckpt, kill_at=4)) == 9  # died in the background write of step 4
    assert (ckpt / f"step-000004{PARTIAL}").is_dir()
    assert (ckpt / LATEST).read_text().strip() == "step-000002"
    cases = _cases()
    with _alone():  # this process as a world of one, as the killed run was
        straight = cases.train(0, 1, **_args(tmp_path / "straight", keep=2))
        capsys.readouterr()
        resumed = cases.train(0, 1, **_args(ckpt, keep=2, resume=True))
    said = capsys.readouterr().out
    assert f"removed {ckpt / 'step-000004'}{PARTIAL}: an incomplete checkpoint" in said
    assert resumed["start"] == 2 and resumed["losses"] == straight["losses"][2:]
    assert _equal(resumed["final"], straight["final"])
    for folder in (ckpt, tmp_path / "straight"):
        kept = sorted(p.name for p in folder.iterdir() if p.name.startswith("step"))
        assert kept == ["step-000004", "step-000006"]
        assert (folder / LATEST).read_text().strip() == "step-000006"


def _args(directory: Path, **extra: object) -> dict:
    return {"directory": str(directory), "steps": 6, "every": 2, "asynchronous": True, **extra}


def _run_alone(run: dict) -> int | None:
    """``run`` (``async_checkpoint_cases.train``'s arguments) in a process of its own (forked
    from the harness's server, which imported torch once): its exit status."""
    process = context().Process(target=_cases().alone, args=(run,), daemon=True)
    process.start()
    process.join(timeout=120)
    if process.is_alive():
        process.kill()
    return process.exitcode


@contextlib.contextmanager
def _alone():
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _cases():
    import async_checkpoint_cases

    return async_checkpoint_cases


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "given", [{"async_checkpoint": True}, {"keep_checkpoints": 2}, {"overwrite_checkpoints": True}]
)
def test_the_checkpoint_flags_need_a_checkpoint_dir(given: dict) -> None:
    from pipetrain.app.checkpoints import check_directory
    from pipetrain.app.config import TrainConfig

    flag = "--" + next(iter(given)).replace("_", "-")
    with pytest.raises(ValueError, match=f"^{flag} needs --checkpoint-dir DIR$"):
        check_directory(TrainConfig(**given))
    with pytest.raises(ValueError, match="--keep-checkpoints must be > 0, got 0"):
        TrainConfig(checkpoint_dir="ckpt", keep_checkpoints=0)


def test_a_checkpoint_without_its_marker_is_incomplete_unless_written_before_markers(
    tmp_path: Path,
) -> None:
    model = _model()
    path = tmp_path / "step"
    save_checkpoint(path, model)
    (path / COMPLETE).unlink()  # what a copy or a removal cut short leaves
    with pytest.raises(ValueError, match=f"{path} is incomplete: it has no {COMPLETE} marker"):
        load_checkpoint(path, _model())
    sums = checksums.read_sums(path)
    del sums[COMPLETE]  # as a writer before markers left it
    checksums.write_sums(path, sums)
    fresh = _model()
    load_checkpoint(path, fresh, verify=True)
    assert _equal(fresh.state_dict(), model.state_dict())


def test_a_writer_other_than_thread_or_process_is_refused() -> None:
    with pytest.raises(ValueError, match="writer must be one of thread, process, got 'disk'"):
        AsyncCheckpointer(writer="disk")


def _process_writer_case(rank: int, world: int, folder: str) -> bool:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    taken = {k: v.clone() for k, v in model.state_dict().items()}
    with AsyncCheckpointer(writer="process") as writer:
        writer.save(Path(folder) / "step", model, opt)
        _step(model, opt, 1)
    fresh = _model()
    load_checkpoint(Path(folder) / "step", fresh, verify=True)
    return all(torch.equal(taken[k], v) for k, v in fresh.state_dict().items())


@pytest.mark.stress
def test_dcps_checkpoint_process_writes_the_same_checkpoint(tmp_path: Path) -> None:
    """``writer="process"``: DCP's checkpoint process writes the folder (in a process of its own
    here, so that DCP's process ends with it)."""
    assert launch(1, _process_writer_case, str(tmp_path), timeout=180) == [True]
