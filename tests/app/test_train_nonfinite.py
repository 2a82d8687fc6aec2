"""A loss that turns nan or inf stops ``pipetrain train`` at that step, naming it, with exit
status 1 and no traceback; ``--on-nonfinite skip`` skips those steps' updates instead and names
them at the end (``--max-skipped``: stopping after that many in a row). ``--lr 1000`` makes the tiny model's loss nan within a few steps."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "16"]
TINY += ["-m", "2", "--microbatch-size", "2", "--steps", "12", "--lr", "1000", "--timeout", "60"]


def _train(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "pipetrain", "train", *TINY, *flags]
    cmd += ["--svg", str(tmp_path / "s.svg"), "--corpus-out", str(tmp_path / "corpus.txt")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_a_nonfinite_loss_stops_the_run_naming_the_step(tmp_path: Path) -> None:
    done = _train(tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert re.search(r"the loss is (nan|inf|-inf) at step \d+: stopped", lines[0]), lines[0]
    assert "--on-nonfinite skip" in lines[0] and "Traceback" not in done.stderr


def test_on_nonfinite_skip_finishes_and_names_the_skipped_steps(tmp_path: Path) -> None:
    done = _train(tmp_path, "--on-nonfinite", "skip", "--max-skipped", "12")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "skipped the update of" in done.stdout, done.stdout
