"""What ``pipetrain train`` records besides the loss (``app.metrics``, ``app.metrics_chart``,
``app.evaluation``, ``app.train.Skips``): the metrics file cut back on resume, TensorBoard
events, model FLOPs, the chart ``pipetrain report`` draws, when evaluations run, and a run that
skips too many steps in a row stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.app.config import TrainConfig
from pipetrain.app.evaluation import eval_due
from pipetrain.app.metrics import MetricsLog, flops_per_token, read_metrics


def _line(step: int, **more) -> str:
    return json.dumps({"step": step, "loss": 5.0 - step / 10, "lr": 1e-3, **more}) + "\n"


def test_a_resumed_run_keeps_the_lines_up_to_its_step_then_appends(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(_line(s) for s in range(1, 5)) + '{"step": 5, "lo')  # cut short
    log = MetricsLog(TrainConfig(metrics=str(path)), start=2, enabled=True)
    log.write({"step": 3, "loss": 1.0})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2, 3]
    MetricsLog(TrainConfig(metrics=str(path)), start=0, enabled=True).close()  # a new run
    assert path.read_text() == ""
    MetricsLog(TrainConfig(metrics=str(tmp_path / "other.jsonl")), start=0, enabled=False)
    assert not (tmp_path / "other.jsonl").exists()  # only rank 0 writes


def test_tensorboard_gets_the_same_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    log = MetricsLog(TrainConfig(tensorboard=str(tmp_path / "tb")), start=0, enabled=True)
    log.write({"step": 1, "loss": 2.5, "lr": 1e-3, "mfu": None})
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "lr"]
    assert events.Scalars("loss")[0].value == 2.5 and events.Scalars("loss")[0].step == 1


def test_tensorboard_without_the_package_is_refused_naming_the_extra(monkeypatch) -> None:
    import importlib.util

    from pipetrain.app.metrics import check_metrics

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install 'pipetrain\[data\]'"):
        check_metrics(TrainConfig(tensorboard="tb"))


def test_model_flops_per_token_are_six_n_plus_the_attention_term() -> None:
    # PaLM's appendix B: 6N + 12 L H T
    assert flops_per_token(1000, layers=2, hidden=8, seq_len=16) == 6000 + 12 * 2 * 8 * 16


def test_the_chart_draws_loss_eval_loss_and_lr(tmp_path: Path) -> None:
    from pipetrain.cli.commands import main

    path = tmp_path / "m.jsonl"
    path.write_text("".join(_line(s, **({"eval_loss": 4.0} if s % 2 else {})) for s in (1, 2, 3)))
    assert main(["report", str(path)]) == 0
    svg = (tmp_path / "m.svg").read_text()
    assert svg.startswith("<svg") and svg.count("<polyline") == 3 and svg.count("<circle") == 2
    assert "eval loss (last 4)" in svg
    path.write_text("not json\n")
    assert main(["report", str(path), "--out", str(tmp_path / "x.svg")]) == 2


def test_evaluations_run_every_n_steps_or_at_checkpoints_and_at_the_end() -> None:
    def due(**fields) -> list[int]:
        config = TrainConfig(eval_data="e.txt", steps=10, **fields)
        return [s for s in range(1, 11) if eval_due(config, s)]

    assert due(eval_every=4) == [4, 8, 10]
    assert due(checkpoint_dir="c", checkpoint_every=3) == [3, 6, 9, 10]
    assert due() == [10]
    assert not eval_due(TrainConfig(steps=10), 10)  # no --eval-data


def test_skip_stops_after_max_skipped_consecutive_steps() -> None:
    from pipetrain.app.train import NonFinite, Skips

    skips = Skips(TrainConfig(on_nonfinite="skip", max_skipped=3))
    skips.skip("the loss is nan", 4, 1e-3)
    skips.skip("the loss is nan", 5, 1e-3)
    skips.passed()  # step 6 updated
    skips.skip("the loss is nan", 7, 1e-3)
    skips.skip("the loss is nan", 8, 1e-3)
    with pytest.raises(NonFinite, match=r"3 consecutive skipped steps \(7, 8, 9; --max-skipped 3"):
        skips.skip("the gradient norm is inf", 9, 1e-3)
    assert skips.steps == [4, 5, 7, 8, 9]
    with pytest.raises(NonFinite, match="the loss is nan at step 2: stopped before"):
        Skips(TrainConfig()).skip("the loss is nan", 2, 1e-3)
