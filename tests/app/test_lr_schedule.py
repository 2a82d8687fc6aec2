"""The learning rate of every step (``app.lr_schedule``): warm-up from 0, cosine and linear decay
to ``--min-lr`` at the end of the run, the defaults of a fine-tune and of a from-scratch run,
the flags that cannot apply refused, and weight decay on matrices only."""

from __future__ import annotations

import itertools
import math

import pytest

from pipetrain.app.config import TrainConfig
from pipetrain.app.lr_schedule import LrSchedule, default_warmup, resolve_schedule


def test_warm_up_is_linear_from_zero_and_reaches_the_peak_after_it() -> None:
    schedule = LrSchedule(lr=1.0, kind="constant", warmup=4, min_lr=0.0, steps=10)
    assert [schedule.at(s) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_cosine_and_linear_decay_to_the_final_rate_at_the_end_of_the_run() -> None:
    cosine = LrSchedule(lr=1.0, kind="cosine", warmup=2, min_lr=0.1, steps=12)
    linear = LrSchedule(lr=1.0, kind="linear", warmup=2, min_lr=0.1, steps=12)
    for schedule in (cosine, linear):
        assert schedule.at(2) == pytest.approx(1.0)  # the first step after the warm-up
        assert schedule.at(7) == pytest.approx(0.55)  # halfway: the mean of peak and end
        assert schedule.at(12) == pytest.approx(0.1) and schedule.at(50) == pytest.approx(0.1)
        rates = [schedule.at(s) for s in range(2, 13)]
        assert all(a > b for a, b in itertools.pairwise(rates))
    assert cosine.at(4) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    assert linear.at(4) == pytest.approx(1.0 - 0.9 * 0.2)


def test_defaults_of_a_fine_tune_and_of_a_run_from_scratch() -> None:
    tune = resolve_schedule(TrainConfig(model_dir="folder", steps=100))
    assert tune == LrSchedule(lr=2e-5, kind="cosine", warmup=3, min_lr=0.0, steps=100)
    scratch = resolve_schedule(TrainConfig(steps=100))
    assert scratch == LrSchedule(lr=3e-3, kind="constant", warmup=0, min_lr=0.0, steps=100)
    given = resolve_schedule(TrainConfig(model_dir="f", lr=1e-4, lr_schedule="linear", warmup=0))
    assert (given.lr, given.kind, given.warmup) == (1e-4, "linear", 0)
    assert [default_warmup(n) for n in (1, 2, 10, 100, 1000)] == [0, 1, 1, 3, 30]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"min_lr": 1e-4}, "--min-lr is where a decay ends"),
        ({"lr_schedule": "cosine", "lr": 1e-3, "min_lr": 1e-2}, "above the peak --lr"),
        ({"warmup": 10, "steps": 10}, "--warmup 10 leaves none of --steps 10"),
    ],
)
def test_flags_that_cannot_apply_are_refused(fields, message) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_schedule(TrainConfig(**fields))


def test_weight_decay_applies_to_matrices_only() -> None:
    torch = pytest.importorskip("torch")
    from pipetrain.app.lr_schedule import parameter_groups

    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.LayerNorm(4))
    model.append(torch.nn.Linear(4, 3))
    groups = parameter_groups(model.parameters(), 0.1)
    decayed = {id(p) for g in groups if g["weight_decay"] == 0.1 for p in g["params"]}
    assert decayed == {id(model[0].weight), id(model[2].weight)}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    torch.optim.AdamW(groups, lr=1e-3)  # AdamW takes the groups as they are
