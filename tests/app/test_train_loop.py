"""``pipetrain train``'s loop on 2 gloo ranks in float64: the learning-rate schedule reaches the
optimizer, a resumed run continues it with the same rates and losses as a straight one (its
metrics file cut back to the resumed step first), the held-out loss equals the unsplit model's
token mean over the eval set, and a ``--model-dir`` fine-tune with the default optimizer flags
lowers it."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torch")

from runtime_harness import launch

#: the fields that must repeat exactly in a resumed run (tok_per_s and mfu are measured)
EXACT = ("step", "loss", "lr", "grad_norm", "tokens", "padding_tokens", "eval_loss")


def test_schedule_metrics_resume_and_eval_loss(tmp_path):
    from loop_cases import schedule_and_eval_runs

    from pipetrain.app.lr_schedule import LrSchedule

    results = launch(2, schedule_and_eval_runs, str(tmp_path), timeout=240)
    lead = results[0]
    expected = LrSchedule(lr=3e-3, kind="cosine", warmup=2, min_lr=1e-4, steps=6)
    straight = lead["straight_metrics"]
    assert [r["step"] for r in straight] == [1, 2, 3, 4, 5, 6]
    assert [r["lr"] for r in straight] == pytest.approx([expected.at(s) for s in range(6)])
    assert [r["loss"] for r in straight] == lead["straight"]
    for record in straight:
        assert record["tokens"] == 2 * 2 * 16 and record["padding_tokens"] == 0
        assert record["grad_norm"] > 0 and record["tok_per_s"] > 0 and record["mfu"] is None
        assert record["data_ms"] >= 0  # the loop's wait for the batch, inside tok_per_s
    assert [r["step"] for r in straight if "eval_loss" in r] == [3, 6]
    # resumed from step 2: the lines past it replaced, every value as in the straight run
    for result in results:
        assert result["resumed"] == (2, result["straight"][2:])
    resumed = lead["resumed_metrics"]
    assert [[r.get(k) for k in EXACT] for r in resumed] == [
        [r.get(k) for k in EXACT] for r in straight
    ]
    assert straight[-1]["eval_loss"] == pytest.approx(lead["reference_eval"], rel=1e-12, abs=0)
    assert "eval loss" in lead["report"] and "straight.svg" in lead["report"]
    assert lead["chart"].count("<polyline") == 3 and lead["chart"].count("<circle") == 2


def test_a_fine_tune_with_default_flags_lowers_the_held_out_loss(tmp_path):
    pytest.importorskip("transformers")
    from finetune_cases import write_folder
    from loop_cases import fine_tune_defaults_run

    folder = write_folder(tmp_path / "llama")
    lead = launch(2, fine_tune_defaults_run, str(tmp_path / "run"), folder, timeout=240)[0]
    metrics = lead["metrics"]
    # TRL's SFT defaults: peak 2e-5, a warm-up step (3% of 6, at least 1), cosine to 0
    assert metrics[0]["lr"] == pytest.approx(1e-5) and metrics[1]["lr"] == pytest.approx(2e-5)
    assert metrics[-1]["lr"] == pytest.approx(2e-5 * 0.5 * (1 + math.cos(math.pi * 4 / 5)))
    assert all(r["padding_tokens"] > 0 for r in metrics)
    evals = [r["eval_loss"] for r in metrics if "eval_loss" in r]
    assert len(evals) == 3 and evals[0] > evals[1] > evals[2], evals
    assert evals[-1] == pytest.approx(lead["reference_eval"], rel=1e-12, abs=0)
