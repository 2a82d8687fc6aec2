"""benchmarks/common/intervals.py: the two-level bootstrap's coverage on synthetic step times whose
true ratio is known, and the verdicts that read an interval's far end.

Synthetic launches: each launch scales a row's steps by a launch factor (log-normal; part of it
shared by both rows of the launch, as one machine state is), each step by a log-normal step
factor, and one step in ten by 1.1 (an intermittent hiccup). The rows' medians are 0.97 and 1.00,
so the true ratio is 0.97. Every draw is seeded: the coverages are fixed numbers, and a method
that drops a level of the resampling fails these tests (the launch level: coverage 0.43 where
launches dominate)."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.common.intervals import (
    Interval,
    launch_spread,
    location,
    quotient_interval,
    ratio_interval,
    self_interval,
    step_cv,
    verdict,
)

TRUE = 0.97


def launches(rng, mu, shared, launch_sd, step_sd, steps=20) -> list[list[float]]:
    out = []
    for s in shared:
        f = mu * math.exp(rng.gauss(0, launch_sd) + s)
        out.append(
            [
                f * math.exp(rng.gauss(0, step_sd)) * (1.1 if rng.random() < 0.1 else 1.0)
                for _ in range(steps)
            ]
        )
    return out


def coverage(k, launch_sd, step_sd, shared_sd=0.0, trials=100, pooled=False) -> float:
    """How often the 95% interval holds the true ratio over ``trials`` synthetic measurements of
    ``k`` launches; ``pooled``: every launch's steps poured into one (a steps-only interval)."""
    rng = random.Random(1)
    hits = 0
    for t in range(trials):
        shared = [rng.gauss(0, shared_sd) for _ in range(k)]
        a = launches(rng, TRUE, shared, launch_sd, step_sd)
        b = launches(rng, 1.0, shared, launch_sd, step_sd)
        if pooled:
            a, b = [[t for x in a for t in x]], [[t for x in b for t in x]]
        iv = ratio_interval(a, b, resamples=300, seed=t)
        assert iv is not None
        hits += iv.low <= TRUE <= iv.high
    return hits / trials


def test_one_launch_covers_the_step_noise() -> None:
    assert 0.9 <= coverage(1, 0.0, 0.01) <= 0.99


def test_three_launches_cover_when_step_noise_dominates() -> None:
    # as on the GPUs so far: step CV ~1%, launches within a few tenths of a percent
    assert 0.9 <= coverage(3, 0.002, 0.01, shared_sd=0.005) <= 0.99


def test_the_launch_level_is_resampled() -> None:
    # launch effects 4x the step noise: six launches cover; steps alone (pooled) do not
    assert coverage(6, 0.02, 0.005) >= 0.85
    assert coverage(6, 0.02, 0.005, pooled=True) < 0.7


def test_three_launches_under_cover_large_launch_effects() -> None:
    """The module doc's caveat, measured: with launch effects far above the step noise, three
    launches (ten distinct launch draws) give too narrow an interval."""
    assert coverage(3, 0.02, 0.005) < 0.9


def test_location_is_the_mean_of_launch_medians() -> None:
    assert location([[1, 2, 30], [4, 5, 6]]) == pytest.approx(3.5)
    iv = ratio_interval([[1.0, 1.0], [2.0, 2.0]], [[2.0, 2.0], [2.0, 2.0]], resamples=50)
    assert iv is not None and iv.estimate == pytest.approx(0.75)
    assert (iv.launches, iv.steps) == (2, 2)


def test_unpaired_launches_are_left_out() -> None:
    iv = ratio_interval([[1.0], [], [3.0]], [[1.0], [1.0], []], resamples=20)
    assert iv is not None and iv.launches == 1 and iv.estimate == 1.0
    assert ratio_interval([[]], [[1.0]]) is None


def test_noise_floor_helpers() -> None:
    runs = [[1.0, 1.02, 0.98], [1.01, 1.03, 0.99], [0.99, 1.01, 0.97]]
    floor = self_interval(runs, resamples=200)
    assert floor is not None and floor.low <= 1.0 <= floor.high
    assert self_interval(runs[:1]) is None
    assert launch_spread(runs) == pytest.approx(1.01 / 0.99 - 1)
    cv = step_cv(runs)
    assert cv is not None and 0.015 < cv < 0.025


@pytest.mark.parametrize(
    ("low", "high", "expect"),
    [(0.95, 0.965, "met"), (0.975, 0.99, "missed"), (0.96, 0.98, "undecided")],
)
def test_a_target_is_met_only_by_the_far_end(low, high, expect) -> None:
    iv = Interval((low + high) / 2, low, high, 3, 20)
    assert verdict(iv, 0.97).startswith(expect)
    # efficiency: higher is better, so the far end is the low one
    flipped = {"met": "missed", "missed": "met", "undecided": "undecided"}[expect]
    assert verdict(iv, 0.97, higher_is_better=True).startswith(flipped)
    assert verdict(None, 0.97) == "not measured"


def test_a_quotient_of_two_ratios_measured_apart() -> None:
    """(a / b) / (c / d): the estimate from the locations, and a 95% interval that holds the
    true quotient about as often as it should when each pair is three launches of step noise."""
    iv = quotient_interval([[2.0, 2.0]], [[1.0, 1.0]], [[3.0, 3.0]], [[2.0, 2.0]], resamples=20)
    assert iv is not None and iv.estimate == pytest.approx(2.0 / 1.5)
    assert quotient_interval([[1.0]], [[1.0]], [[]], [[1.0]]) is None
    rng, hits, trials = random.Random(3), 0, 100
    for t in range(trials):
        shared = [rng.gauss(0, 0.003) for _ in range(3)]
        a, b = launches(rng, 1.02, shared, 0.002, 0.01), launches(rng, 1.0, shared, 0.002, 0.01)
        c, d = launches(rng, 0.99, shared, 0.002, 0.01), launches(rng, 1.0, shared, 0.002, 0.01)
        got = quotient_interval(a, b, c, d, resamples=300, seed=t)
        assert got is not None
        hits += got.low <= 1.02 / 0.99 <= got.high
    assert 0.85 <= hits / trials <= 0.995
