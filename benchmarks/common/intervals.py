"""Confidence intervals for step-time ratios over launches and steps (standard library only).

A benchmark row is measured in several *launches* (separate processes, the libraries' order
rotated between them), each with many timed steps. Its step time is the mean over launches of
each launch's median step; a ratio of two rows (pipetrain / Megatron, or the no-pipeline limit /
a row: efficiency) is the ratio of those means, over the launches both rows ran in.

The 95% interval is a two-level percentile bootstrap (Davison & Hinkley, "Bootstrap Methods",
§3.8): draw the launches with replacement (the two rows stay paired: a launch's machine state
touches both), then within each drawn launch draw each row's steps with replacement, and take the
ratio of the resampled means of medians; the interval is the 2.5 and 97.5 percentiles of that
ratio. With one launch it is an interval over steps alone and says nothing of launch-to-launch
spread; with three, the launch level has only ten distinct draws, so launch effects larger than
the step noise are under-covered (tests/benchmarks/test_intervals.py measures both).

A target is met only where the interval's far end meets it (``verdict``).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

Launches = Sequence[Sequence[float]]  # per launch, the timed steps' times


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float
    launches: int
    steps: int  # fewest timed steps of any launch of either row

    def __str__(self) -> str:
        return f"{self.estimate:.3f} [{self.low:.3f}, {self.high:.3f}]"

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def location(launches: Launches) -> float:
    """A row's step time: the mean over launches of each launch's median step."""
    return statistics.fmean(statistics.median(steps) for steps in launches)


def _paired(a: Launches, b: Launches) -> tuple[list[list[float]], list[list[float]]]:
    pairs = [(list(x), list(y)) for x, y in zip(a, b) if x and y]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def ratio_interval(
    a: Launches,
    b: Launches,
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval | None:
    """``location(a) / location(b)`` with its two-level bootstrap interval (module doc).

    ``a[i]`` and ``b[i]`` are the same launch's steps of the two rows; launches where either row
    has no steps are left out. ``None`` when no launch has both."""
    a, b = _paired(a, b)
    if not a:
        return None
    draws = _ratio_draws(a, b, resamples, random.Random(seed))
    lo, hi = _percentiles(draws, level)
    steps = min(len(x) for x in a + b)
    return Interval(location(a) / location(b), lo, hi, len(a), steps)


def quotient_interval(
    a: Launches,
    b: Launches,
    c: Launches,
    d: Launches,
    *,
    resamples: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> Interval | None:
    """``(location(a) / location(b)) / (location(c) / location(d))`` with a bootstrap interval:
    a ratio measured in one setting over the same ratio in another (compile / eager under the
    pipeline over compile / eager unsplit). ``a``/``b`` are paired by launch, ``c``/``d`` too;
    the two pairs are measured apart, so they are resampled independently. ``None`` when either
    pair has no common launch."""
    a, b = _paired(a, b)
    c, d = _paired(c, d)
    if not a or not c:
        return None
    rng = random.Random(seed)
    top, bottom = _ratio_draws(a, b, resamples, rng), _ratio_draws(c, d, resamples, rng)
    lo, hi = _percentiles([x / y for x, y in zip(top, bottom)], level)
    estimate = (location(a) / location(b)) / (location(c) / location(d))
    steps = min(len(x) for x in a + b + c + d)
    return Interval(estimate, lo, hi, min(len(a), len(c)), steps)


def _ratio_draws(
    a: list[list[float]], b: list[list[float]], resamples: int, rng: random.Random
) -> list[float]:
    """Bootstrap draws of the ratio of means of medians: launches drawn with replacement (the
    rows stay paired), then each drawn launch's steps."""
    k = len(a)
    median = statistics.median
    draws: list[float] = []
    for _ in range(resamples):
        num = den = 0.0
        for i in (rng.randrange(k) for _ in range(k)) if k > 1 else (0,):
            xs, ys = a[i], b[i]
            num += median(rng.choices(xs, k=len(xs)))
            den += median(rng.choices(ys, k=len(ys)))
        draws.append(num / den)
    return draws


def _percentiles(draws: list[float], level: float) -> tuple[float, float]:
    draws = sorted(draws)
    n, tail = len(draws), (1 - level) / 2
    return draws[max(0, math.floor(tail * n))], draws[min(n - 1, math.ceil((1 - tail) * n) - 1)]


def self_interval(launches: Launches, **kw) -> Interval | None:
    """A row against itself, each launch paired with the next (the last with the first): the
    interval around 1 that launch-to-launch and step-to-step noise alone give (the noise floor).
    ``None`` with fewer than two launches."""
    runs = [list(x) for x in launches if x]
    if len(runs) < 2:
        return None
    return ratio_interval(runs, runs[1:] + runs[:1], **kw)


def step_cv(launches: Launches) -> float | None:
    """The step-to-step coefficient of variation within launches (pooled over launches)."""
    cvs = [statistics.stdev(x) / statistics.fmean(x) for x in launches if len(x) > 1]
    return statistics.fmean(cvs) if cvs else None


def launch_spread(launches: Launches) -> float | None:
    """Largest over smallest launch median, less one (0.01: launches 1% apart)."""
    meds = [statistics.median(x) for x in launches if x]
    return max(meds) / min(meds) - 1 if len(meds) > 1 else None


def verdict(iv: Interval | None, target: float, *, higher_is_better: bool = False) -> str:
    """``met`` only if the interval's far end meets the target, ``missed`` if its near end misses
    it, else ``undecided`` (the interval straddles the target)."""
    if iv is None:
        return "not measured"
    far, near = (iv.low, iv.high) if higher_is_better else (iv.high, iv.low)
    if (far >= target) if higher_is_better else (far <= target):
        return "met"
    if (near < target) if higher_is_better else (near > target):
        return "missed"
    return "undecided (the interval straddles the target)"
