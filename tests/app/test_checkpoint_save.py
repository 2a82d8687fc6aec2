"""A checkpoint ``pipetrain train`` saves is complete, and named by ``latest``, on every rank by
the time ``save`` returns there — a run resumed right after (the same processes) finds it, on
every rank, however late the lead moves the pointer."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from runtime_harness import launch
from train_cases import pointer_after_save, resume_refused_on_one_rank


@pytest.mark.slow
def test_save_returns_on_every_rank_after_latest_names_the_checkpoint(tmp_path) -> None:
    assert launch(2, pointer_after_save, str(tmp_path / "ckpt"), timeout=120) == [True, True]


@pytest.mark.slow
def test_a_resume_one_rank_cannot_make_is_refused_on_every_rank(tmp_path) -> None:
    """Before the collective load every rank says what it found: a rank whose directory holds no
    checkpoint refuses there, and the others refuse naming it, instead of waiting in the load."""
    said = launch(
        2,
        resume_refused_on_one_rank,
        str(tmp_path / "ckpt"),
        str(tmp_path / "elsewhere"),
        timeout=60,
    )
    assert said[1].startswith("no checkpoint to resume from in "), said
    assert said[0] == f"rank 1: {said[1]}", said
