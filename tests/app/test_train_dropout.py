"""``pipetrain train --model-dir`` on a GPT-2 folder with its default dropout (0.1): two runs of
one command equal bit for bit, 2 steps + ``--resume`` to 4 equal 4 straight, and another
schedule (ZBV's V placement, another order of micro-batches) draws the same masks."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from dropout_train_cases import dropout_runs, write_dropout_folder
from runtime_harness import launch


def test_dropout_is_reproducible_across_runs_resumes_and_schedules(tmp_path):
    folder = write_dropout_folder(tmp_path / "gpt2")
    plain = write_dropout_folder(tmp_path / "gpt2-plain", p=0.0)
    results = launch(2, dropout_runs, str(tmp_path), folder, plain, timeout=240)
    for r in results:
        first, again = r["1f1b"]
        assert first == again  # bit for bit
        assert r["resumed"] == (2, first[2:])  # bit for bit
        assert r["zbv"] == pytest.approx(first, rel=1e-12, abs=0)
        assert r["plain"][0] != pytest.approx(first[0], rel=1e-6)  # dropout was drawn
