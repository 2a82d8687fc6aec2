"""``pipetrain train --global-batch-tokens``: each step runs the micro-batch count its documents
fill, on 2 gloo ranks in float64, and equals the unsplit ``transformers`` model trained on the
same packed batches (1F1B, ZBV, ``--dp 2`` and ``--tp 2``); a run resumed mid-way sees the same batches,
bit for bit."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from finetune_cases import write_folder
from runtime_harness import launch
from varlen_train_cases import budget_runs

SCHEDULES = ("1f1b", "zbv")  # DualPipeV: tests/runtime/test_microbatch_count.py


@pytest.mark.slow
def test_token_budget_steps_equal_the_unsplit_model_and_resume(tmp_path):
    folder = write_folder(tmp_path / "llama", "llama")
    results = launch(2, budget_runs, str(tmp_path), folder, SCHEDULES, timeout=240)
    for schedule in SCHEDULES:
        lead = results[0][schedule]
        assert len(set(lead["counts"])) > 1, lead["counts"]  # the count does change
        assert lead["recorded"] == lead["counts"]  # --metrics records each step's count
        _check_report(lead["report"], lead["counts"])
        assert lead["straight"] == pytest.approx(lead["reference"], rel=1e-12, abs=0), schedule
        if "dp" in lead:
            assert lead["dp"] == pytest.approx(lead["dp_reference"], rel=1e-12, abs=0)
        if "tp" in lead:
            assert lead["tp"] == pytest.approx(lead["tp_reference"], rel=1e-12, abs=0)
        for result in (r[schedule] for r in results):
            assert result["counts"] == lead["counts"]
            if "resumed" in result:
                assert result["resumed"] == (2, result["straight"][2:])  # bit for bit


def test_batches_built_in_the_loop_or_further_ahead_train_alike(tmp_path):
    """``--prefetch-batches`` 0 (no thread) and 2 train on the batches the default 1 does: the
    same losses, bit for bit, over steps of different micro-batch counts."""
    from prefetch_cases import prefetch_runs

    folder = write_folder(tmp_path / "llama", "llama")
    losses = launch(2, prefetch_runs, str(tmp_path), folder, timeout=240)[0]
    assert len(losses[1]) == 3 and len(set(losses[1])) == 3  # three steps, each its own loss
    assert losses[0] == losses[1] == losses[2]


def _check_report(text: str, counts: list[int]) -> None:
    """The report names every step's count, and simulates its median step with the program of
    the count that step ran (the title's: the measured timeline's own program)."""
    from pipetrain.app.report import counts_line

    lines = text.splitlines()
    assert counts_line(counts) in lines, text
    title = next(x for x in lines if x.endswith("measured step (ms)"))
    found = re.search(r"(\d+) micro-batches", title)
    assert found is not None and int(found.group(1)) in counts, title
    assert f"with the program of its own {found.group(1)} micro-batches" in text, text


def test_budget_and_costs_flags_are_refused_where_they_cannot_apply(tmp_path):
    """Each refused by the launcher's checks, naming the fix."""
    from finetune_cases import train_args

    from pipetrain.app.train_checks import check_arguments

    folder = write_folder(tmp_path / "llama", "llama")
    text = tmp_path / "text.txt"
    text.write_text("a short line\nanother one\n")
    base = ["--model-dir", folder, "--seq-len", "16", "--microbatch-size", "2", "--data", str(text)]
    base += ["--data-cache", str(tmp_path / "cache")]
    cases = {
        ("--global-batch-tokens", "200", "--packing", "none"): "drop --packing none",
        ("--global-batch-tokens", "200", "-m", "4"): "drop -m/--microbatches",
        ("--global-batch-tokens", "63"): "give at least 64",  # 2 x 2 rows x 16 on 1f1b's 2 ranks
        ("--global-batch-tokens", "64", "-s", "dualpipev"): "give at least 128",
        ("--costs", str(tmp_path / "none.json"), "--microbatch-balance", "fixed"): "needs",
        ("--costs", str(tmp_path / "none.json")): "none.json",
    }
    for args, message in cases.items():
        with pytest.raises(ValueError, match=message):
            check_arguments(train_args(*base, *args))
    with pytest.raises(ValueError, match="--global-batch-tokens: for a --model-dir folder"):
        check_arguments(train_args("--global-batch-tokens", "200"))
    layout = check_arguments(train_args(*base, "--global-batch-tokens", "200"))
    assert layout.microbatches == 6  # 200 / (2 rows x 16 tokens) = 6.25: the nearest count
