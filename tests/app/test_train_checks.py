"""``pipetrain train`` checks its folders and files before any process starts: the checkpoint
folder (writable, made if missing, holding checkpoints only on purpose), the text (long enough
for one batch), the checkpoint to resume (complete, of this model; else the last complete one is
named). Bad input is one line and exit 2."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipetrain.app.checkpoints import (  # noqa: E402
    INFO,
    LATEST,
    Checkpoints,
    incomplete_checkpoints,
)
from pipetrain.app.config import TrainConfig  # noqa: E402
from pipetrain.app.train_checks import check_arguments  # noqa: E402
from pipetrain.cli.train_command import config_from_argv  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> TrainConfig:
    return config_from_argv(argv)


def test_the_checkpoint_folder_must_be_a_writable_folder_and_is_made(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("not a folder")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_arguments(_args("--checkpoint-dir", str(file)))
    with pytest.raises(ValueError, match="is not a writable folder"):
        check_arguments(_args("--checkpoint-dir", str(file / "below")))
    if Path("/proc/self").is_dir():  # not writable even by root
        with pytest.raises(ValueError, match="is not a writable folder"):
            check_arguments(_args("--checkpoint-dir", "/proc/self/ckpt"))
    made = tmp_path / "a" / "b"
    check_arguments(_args("--checkpoint-dir", str(made)))
    assert made.is_dir()


def test_a_folder_holding_checkpoints_needs_resume_or_overwrite(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    (folder / "step-000020").mkdir(parents=True)
    (folder / LATEST).write_text("step-000020\n")
    with pytest.raises(ValueError, match=r"holds checkpoints \(up to step-000020\).*--resume.*"):
        check_arguments(_args("--checkpoint-dir", str(folder)))
    with pytest.raises(ValueError, match="--overwrite-checkpoints"):
        check_arguments(_args("--checkpoint-dir", str(folder)))
    check_arguments(_args("--checkpoint-dir", str(folder), "--overwrite-checkpoints"))
    with pytest.raises(ValueError, match="give one of them"):
        check_arguments(
            _args("--checkpoint-dir", str(folder), "--overwrite-checkpoints", "--resume")
        )
    with pytest.raises(ValueError, match="--overwrite-checkpoints needs --checkpoint-dir"):
        check_arguments(_args("--overwrite-checkpoints"))
    partial_only = tmp_path / "partial"
    (partial_only / "step-000010.partial").mkdir(parents=True)
    check_arguments(_args("--checkpoint-dir", str(partial_only)))  # no checkpoint in it


@pytest.mark.parametrize("size", [0, 100])
def test_a_text_too_short_for_one_batch_is_refused(tmp_path: Path, size: int) -> None:
    text = tmp_path / "t.txt"
    text.write_bytes(b"a" * size)
    # 4 rows a micro-batch × 4 micro-batches × 1 replica, 64 bytes and a target each
    with pytest.raises(
        ValueError, match=rf"has {size} bytes; one batch of 16 rows .* at least 1040"
    ):
        check_arguments(_args("--text", str(text)))
    text.write_bytes(b"a" * 1040)
    check_arguments(_args("--text", str(text)))


def _write_checkpoints(folder: Path, config: TrainConfig, steps: list[int]) -> None:
    """Checkpoints as ``pipetrain train`` writes them (a stand-in model: only the files and the
    model's shape in ``train.json`` are read before launch)."""
    import pipetrain

    for step in steps:
        info = {"step": step, "model": dataclasses.asdict(config.shape)}
        files = {INFO: json.dumps(info)}
        pipetrain.save_checkpoint(folder / f"step-{step:06d}", torch.nn.Linear(2, 2), files=files)
    (folder / LATEST).write_text(f"step-{steps[-1]:06d}\n")


def test_resume_names_a_corrupt_latest_checkpoint_and_the_last_complete_one(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "ckpt"
    config = _args("--checkpoint-dir", str(folder), "--resume")
    _write_checkpoints(folder, config, [2, 4])
    check_arguments(config)
    shard = next((folder / "step-000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    with pytest.raises(ValueError) as e:
        check_arguments(config)
    said = str(e.value)
    assert f"{shard.name} has 10 bytes" in said and "truncated" in said, said
    assert "the last complete checkpoint" in said and "is step-000002" in said, said
    # removing the broken one resumes from the last complete one
    import shutil

    shutil.rmtree(folder / "step-000004")
    assert Checkpoints(folder, config.shape).latest()[1] == 2
    (folder / "step-000006.partial").mkdir()
    assert [p.name for p in incomplete_checkpoints(config)] == ["step-000006.partial"]


def _train(*flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipetrain", "train", *flags]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)


def _train_here(capsys, *flags: str) -> tuple[int, str, str]:
    """``pipetrain train FLAGS`` in this process (the launcher's side: what it checks before
    any process starts): exit status, stdout, stderr."""
    from pipetrain.cli import main

    code = main(["train", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_bad_folders_exit_2_with_one_line_before_any_process(tmp_path: Path, capsys) -> None:
    """The first as a real process (the status the shell sees), the second in this process."""
    file = tmp_path / "file"
    file.write_text("x")
    done = _train("--checkpoint-dir", str(file))
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "is a file, not a folder" in done.stderr, done.stderr
    assert "launching" not in done.stdout
    code, out, err = _train_here(capsys, "--text", str(file))
    assert code == 2, err
    assert err.count("\n") == 1 and "has 1 bytes" in err, err
    assert "launching" not in out


def test_overwrite_checkpoints_replaces_a_previous_runs_checkpoints(tmp_path: Path, capsys) -> None:
    tiny = ["--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16"]
    tiny += [
        "-m",
        "2",
        "--microbatch-size",
        "2",
        "--timeout",
        "60",
        "--svg",
        str(tmp_path / "s.svg"),
    ]
    tiny += ["--corpus-out", str(tmp_path / "corpus.txt"), "--checkpoint-dir", str(tmp_path / "c")]
    done = _train(*tiny, "--steps", "3", "--checkpoint-every", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    code, _, err = _train_here(capsys, *tiny, "--steps", "2")  # refused before any process
    assert code == 2 and "--overwrite-checkpoints" in err, err
    done = _train(*tiny, "--steps", "1", "--overwrite-checkpoints")
    assert done.returncode == 0, done.stdout + done.stderr
    kept = sorted(p.name for p in (tmp_path / "c").iterdir() if p.name != ".lock")
    assert kept == ["latest", "step-000001"]
    assert (tmp_path / "c" / "latest").read_text().strip() == "step-000001"


def test_cuda_graph_is_refused_where_the_runtime_cannot_capture_before_any_process(
    capsys,
) -> None:
    for argv, said in (
        (("--device", "cpu"), "--cuda-graph captures each step on a GPU"),
        (("--dp", "2"), "--cuda-graph with --dp or --tp is not supported yet"),
    ):
        with pytest.raises(ValueError, match=said):
            check_arguments(_args("--cuda-graph", *argv))
    code, _, err = _train_here(capsys, "--cuda-graph", "--device", "cpu")
    assert code == 2 and err.count("\n") == 1 and "--cuda-graph" in err, err
