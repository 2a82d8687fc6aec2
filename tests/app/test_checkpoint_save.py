"""A checkpoint ``pipetrain train`` saves is complete, and named by ``latest``, on every rank by
the time ``save`` returns there — a run resumed right after (the same processes) finds it, on
every rank, however late the lead moves the pointer."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from runtime_harness import launch
from train_cases import pointer_after_save


@pytest.mark.slow
def test_save_returns_on_every_rank_after_latest_names_the_checkpoint(tmp_path) -> None:
    assert launch(2, pointer_after_save, str(tmp_path / "ckpt"), timeout=120) == [True, True]
