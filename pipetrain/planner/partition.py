"""Contiguous layer boundaries: cut ``n`` layers into ``k`` stages, each at least one layer.

A cut is a tuple of layer counts per stage (``stage_layers``); every function here returns counts
that sum to ``n`` with every count >= 1, so a layer is never dropped or duplicated.

The time-balanced cut solves the min-max (bottleneck) partition exactly: the optimal bottleneck
is one of the O(n²) contiguous interval sums, and for a given bound ``T`` a greedy scan that
gives each stage as many layers as fit decides feasibility (exchange argument: after each stage
the greedy end is at least any feasible cut's end, since a suffix of a feasible interval is
feasible), so a binary search over the sorted interval sums finds the least feasible ``T``
(Bokhari 1988 style; O(n² log n) for the sums, O(n log n) checks). With extra per-stage limits
(a memory cap per stage position, monotone under taking a sub-interval) the greedy is no longer
exact: a stage's cap can refuse a layer that a later greedy end pushes onto it while an earlier
stage could have held it (``[0, 2, 0, 0]`` into 3 stages, stage ``s`` holding a sum of at most
``2 - s``: greedy from the back fails, ``[2, 1, 1]`` fits). There feasibility is decided exactly
by a table over (stage, first layer) built back to front, O(k·n) per bound: by monotonicity the
ends a stage may take from a first layer form a range whose far end only grows with the first
layer, so two pointers find it, and prefix counts say whether the later stages can finish from
any end in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

#: ``fits(stage, first, end)``: may stage ``stage`` hold layers ``first..end-1``?
Limit = Callable[[int, int, int], bool]


def uniform_cut(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """As even as counts go; the earlier stages take the remainder (Megatron, torchtitan's
    default)."""
    _check(num_layers, num_stages)
    base, extra = divmod(num_layers, num_stages)
    return tuple(base + (1 if s < extra else 0) for s in range(num_stages))


def min_max_cut(
    weights: Sequence[float],
    num_stages: int,
    limit: Limit | None = None,
    from_the_back: bool = False,
) -> tuple[int, ...] | None:
    """The cut minimising the largest stage sum of ``weights`` among cuts where every stage
    meets ``limit``; ``None`` when no cut meets it. Among optimal cuts, the one that fills the
    front stages first (or the back ones, ``from_the_back``)."""
    n = len(weights)
    _check(n, num_stages)
    if from_the_back:
        rev = weights[::-1]
        rev_limit = None
        if limit is not None:

            def rev_limit(stage: int, first: int, end: int) -> bool:
                return limit(num_stages - 1 - stage, n - end, n - first)

        cut = min_max_cut(rev, num_stages, rev_limit)
        return None if cut is None else cut[::-1]
    prefix = [0.0, *accumulate(weights)]
    fill = _greedy if limit is None else _fill_exactly
    if fill(prefix, num_stages, float("inf"), limit) is None:
        return None
    sums = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(sums) - 1  # sums[hi] (the whole model) is always feasible
    while lo < hi:
        mid = (lo + hi) // 2
        if fill(prefix, num_stages, sums[mid], limit) is None:
            lo = mid + 1
        else:
            hi = mid
    return fill(prefix, num_stages, sums[lo], limit)


def even_min_max_cut(
    weights: Sequence[float], num_stages: int, limit: Limit | None = None
) -> tuple[int, ...] | None:
    """An optimal min-max cut (same bottleneck as ``min_max_cut``) that spreads the rest evenly:
    each stage in turn ends where its sum comes closest to an equal share of what is left, among
    the ends from which the later stages can still finish within the bottleneck and ``limit``.

    The front- and back-filled optimal cuts load every non-bottleneck stage up to the bottleneck
    on one side and leave single layers on the other; this one keeps the stages that need not be
    at the bottleneck near the mean, which fill and drain faster and hold less."""
    best = min_max_cut(weights, num_stages, limit)
    if best is None:
        return None
    n = len(weights)
    prefix = [0.0, *accumulate(weights)]
    bound = max(prefix[b] - prefix[a] for a, b in bounds(best))

    can, far = _finishable(n, num_stages, _within(prefix, bound, limit))
    cut, first = [], 0
    for stage in range(num_stages):
        share = (prefix[n] - prefix[first]) / (num_stages - stage)
        ends = [e for e in range(first + 1, far[stage][first] + 1) if can[stage + 1][e]]
        end = min(ends, key=lambda e: (abs(prefix[e] - prefix[first] - share), e))
        cut.append(end - first)
        first = end
    return tuple(cut)


def rank_balanced_cut(
    weights: Sequence[float],
    start: tuple[int, ...],
    rank_of_stage: Sequence[int],
    pair_moves_up_to: int = 32,
) -> tuple[int, ...]:
    """A cut whose busiest *rank* is as light as a local search finds, for placements with
    several stages per rank (rank ``rank_of_stage[s]`` runs stage ``s``; a chain shorter than
    ``rank_of_stage`` repeats, as DualPipe's two copies do).

    With one stage per rank this is the min-max problem above; with several, a rank's load is a
    sum over distant stages and no interval search applies, so this descends from ``start`` on
    (largest rank load, sum of squared rank loads) by moving one boundary one layer, or two
    boundaries for chains up to ``pair_moves_up_to`` stages, until no move improves."""
    prefix = [0.0, *accumulate(weights)]
    chain = len(start)
    num_ranks = max(rank_of_stage) + 1

    def score(cut: tuple[int, ...]) -> tuple[float, float]:
        blocks = [prefix[b] - prefix[a] for a, b in bounds(cut)]
        load = [0.0] * num_ranks
        for stage, rank in enumerate(rank_of_stage):
            load[rank] += blocks[stage % chain]
        return max(load), sum(x * x for x in load)

    def moves(cut: tuple[int, ...]) -> list[tuple[int, ...]]:
        out = []
        for i in range(chain - 1):
            for give, take in ((i, i + 1), (i + 1, i)):
                if cut[give] > 1:
                    moved = list(cut)
                    moved[give] -= 1
                    moved[take] += 1
                    out.append(tuple(moved))
        return out

    best, best_score = start, score(start)
    for _ in range(len(weights) * chain):  # each accepted move lowers the score: this bounds it
        singles = moves(best)
        tries = singles + (
            [m2 for m1 in singles for m2 in moves(m1)] if chain <= pair_moves_up_to else []
        )
        found = min(tries, key=score, default=best)
        if score(found) >= best_score:
            break
        best, best_score = found, score(found)
    return best


def _greedy(
    prefix: Sequence[float], num_stages: int, bound: float, limit: Limit | None
) -> tuple[int, ...] | None:
    """Each stage takes as many layers as keep its sum <= bound and meet ``limit``, leaving one
    layer for each stage after it; ``None`` if the layers do not fit."""
    n = len(prefix) - 1
    cut, first = [], 0
    for stage in range(num_stages):
        last_end = n - (num_stages - 1 - stage)
        end = first
        while (
            end < last_end
            and prefix[end + 1] - prefix[first] <= bound
            and (limit is None or limit(stage, first, end + 1))
        ):
            end += 1
        if end == first:
            return None
        cut.append(end - first)
        first = end
    return tuple(cut) if first == n else None


def _fill_exactly(
    prefix: Sequence[float], num_stages: int, bound: float, limit: Limit | None
) -> tuple[int, ...] | None:
    """The cut that gives each stage in turn as many layers as keep its sum <= bound and meet
    ``limit`` *while the later stages can still finish*; ``None`` if no cut does (module
    docstring: exact for stage-dependent limits, where ``_greedy`` is not)."""
    n = len(prefix) - 1

    can, far = _finishable(n, num_stages, _within(prefix, bound, limit))
    if not can[0][0]:
        return None
    cut, first = [], 0
    for stage in range(num_stages):
        end = far[stage][first]
        while not can[stage + 1][end]:
            end -= 1
        cut.append(end - first)
        first = end
    return tuple(cut)


def _within(prefix: Sequence[float], bound: float, limit: Limit | None) -> Limit:
    """``limit`` and a stage sum of at most ``bound``."""

    def ok(stage: int, first: int, end: int) -> bool:
        return prefix[end] - prefix[first] <= bound and (limit is None or limit(stage, first, end))

    return ok


def _finishable(n: int, num_stages: int, ok: Limit) -> tuple[list[list[bool]], list[list[int]]]:
    """``can[s][j]``: stages ``s..`` can hold layers ``j..n-1``, each at least one layer and
    meeting ``ok``; ``far[s][j]``: the last end stage ``s`` may take from first layer ``j``.
    Built back to front in O(k·n): ``ok`` is monotone under taking a sub-interval, so the ends
    a stage may take form a range whose far end only grows with the first layer (two pointers),
    and prefix counts say whether the later stages can finish from any end in it."""
    can = [[False] * (n + 1) for _ in range(num_stages + 1)]
    far = [[0] * n for _ in range(num_stages)]
    can[num_stages][n] = True
    for stage in range(num_stages - 1, -1, -1):
        later = can[stage + 1]
        count = list(accumulate(later, initial=0))  # count[j]: how many of later[:j] hold
        end = 0
        # a first layer the stage can hold from: every stage before and after it takes at
        # least one layer (``can`` is False elsewhere, and ``_fill_exactly`` reads no other)
        for first in range(stage, n - num_stages + stage + 1):
            end = max(end, first)
            while end < n and ok(stage, first, end + 1):
                end += 1
            far[stage][first] = end
            can[stage][first] = end > first and count[end + 1] - count[first + 1] > 0
    return can, far


def bounds(cut: Sequence[int]) -> list[tuple[int, int]]:
    """``(first, end)`` layer range of each stage."""
    ends = list(accumulate(cut))
    return [(end - count, end) for count, end in zip(cut, ends)]


def _check(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"a cut needs at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"{num_layers} layers cannot fill {num_stages} stages: every stage needs at least one"
        )
