"""How the event loop (``schedule.execute``) runs each action: a ``Plan`` per (kind, stage) at
micro-batch 0, compiled once per run from the dependency rule (``deps.compile_rule``) and the
caller's ``duration`` and ``latency``, and one per shape of overlapped pair as the loop meets it.

The loop runs once per action of every lowering, validation and simulation, so it asks
``duration`` and ``latency`` up front, once per (kind, stage), not once per action and
dependency: a plan holds the values an action needs (as integers, with each one's producer rank
and latency), the values it produces that others await, and its times. The plain loop keeps
when each value was produced in a list indexed by value (``value_table``): a subscript per need.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from pipetrain.schedule import deps
from pipetrain.schedule.action import Action, OpKind


class Input(NamedTuple):
    """A value an action waits for, and what it costs to reach another rank."""

    value: int
    producer_rank: int
    latency: float


class Plan(NamedTuple):
    """How the loop runs one (kind, stage) at micro-batch 0, or one overlapped pair."""

    needs: tuple[Input, ...]
    #: the values it produces that others await (``deps.CompiledRule.awaited``)
    awaited: tuple[int, ...]
    #: from an idle start, host and device together (``duration``)
    cost: float
    #: the host's time to issue it (0: the plain model)
    host: float
    #: the device's time with its kernels queued ahead (the plain model: ``cost``)
    device: float


#: an action's (host time, device time with its kernels queued ahead); the module docstring
Issue = Callable[[Action], tuple[float, float]]


def compile_plans(
    rule: deps.CompiledRule,
    duration: Callable[[Action], float],
    latency: Callable[[deps.Key], float],
    issue: Issue | None,
) -> dict[OpKind, dict[int, Plan]]:
    """``[kind][stage]`` -> the plain action's plan at micro-batch 0 (every kind has a dict)."""
    plans: dict[OpKind, dict[int, Plan]] = {kind: {} for kind in OpKind}
    for kind, needs_of_stage in rule.needs.items():
        for stage, needs in needs_of_stage.items():
            action = Action(kind, stage, 0)
            plans[kind][stage] = Plan(
                tuple(
                    Input(need.value, need.producer_rank, latency((need.token, need.stage, 0)))
                    for need in needs
                ),
                rule.awaited[kind][stage],
                *_times(action, duration, issue),
            )
    return plans


def _times(
    action: Action, duration: Callable[[Action], float], issue: Issue | None
) -> tuple[float, float, float]:
    """(cost, host, device) of a plan (``Plan``)."""
    cost = duration(action)
    host, device = (0.0, cost) if issue is None else issue(action)
    return cost, host, device


def pair_shape(pair: Action) -> tuple[object, ...]:
    """What an overlapped pair's plan depends on: its stage, and each part's kind, stage and
    micro-batch relative to the pair's. Pairs of one shape share a plan, shifted."""
    base, parts = pair.microbatch, pair.parts
    if len(parts) == 2:  # every pair ``overlap`` makes: one flat tuple, no list between
        f, b = parts
        return (
            pair.stage,
            f.kind,
            f.stage,
            f.microbatch - base,
            b.kind,
            b.stage,
            b.microbatch - base,
        )
    return (pair.stage, *[(p.kind, p.stage, p.microbatch - base) for p in parts])


class PairPlans:
    """Plans of overlapped pairs, made as the loop meets them, one per ``pair_shape`` (a DualPipe
    program is mostly pairs, of a few shapes): at the pair's micro-batch, each part's values
    shifted by its micro-batch's offset from the pair's. Every part's inputs must be there before
    the pair starts."""

    def __init__(
        self,
        plans: dict[OpKind, dict[int, Plan]],
        stride: int,
        duration: Callable[[Action], float],
        issue: Issue | None = None,
    ) -> None:
        self.plans, self.stride, self.duration, self.issue = plans, stride, duration, issue
        self.of_shape: dict[tuple[object, ...], Plan] = {}

    def plan(self, pair: Action, produced: dict[int, float]) -> Plan | None:
        """The pair's plan; for a part naming a stage the placement lacks (unvalidated input),
        see ``_bad_part``."""
        shape = pair_shape(pair)
        plan = self.of_shape.get(shape)
        if plan is not None:
            return plan
        needs: list[Input] = []
        awaited: list[int] = []
        for part in pair.parts:
            part_plan = self.plans[part.kind].get(part.stage)
            if part_plan is None:
                return self._bad_part(pair, needs, produced)
            offset = (part.microbatch - pair.microbatch) * self.stride
            needs += [Input(need.value + offset, *need[1:]) for need in part_plan.needs]
            awaited += [value + offset for value in part_plan.awaited]
        plan = self.of_shape[shape] = Plan(
            tuple(needs), tuple(awaited), *_times(pair, self.duration, self.issue)
        )
        return plan

    def _bad_part(
        self, pair: Action, needs: list[Input], produced: dict[int, float]
    ) -> Plan | None:
        """A pair with a part on a stage the placement lacks. Checked part by part, that fails
        only once every earlier part's inputs are there: then the answer is None; before, the pair
        waits on the missing input, so its plan is the earlier parts' needs, and it never runs."""
        shift = pair.microbatch * self.stride
        if all(need.value + shift in produced for need in needs):
            return None
        return Plan(tuple(needs), (), 0.0, 0.0, 0.0)


class SparseValues(dict[int, float]):
    """A value table for micro-batches too far apart for a list: a missing value reads None."""

    def __missing__(self, _: int) -> None:
        return None


def value_table(
    rows: Sequence[Sequence[Action]],
    folded: Sequence[Sequence[object]],
    row_shifts: Sequence[Sequence[int]],
    stride: int,
) -> tuple[int, Any]:
    """(base, table) for ``execute``'s plain loop: a list indexed by value less ``base`` where the
    micro-batches span at most a few times the rows' length, a subscript being cheaper than
    ``dict.get`` once per action; a ``SparseValues`` dict otherwise (unvalidated input naming
    far-off micro-batches). The span is read off each action's shift (micro-batch · ``stride``)
    and, in a row with an action without a plan (``folded``: an overlapped pair), its parts'."""
    low = high = 0
    for row, plans_of_row, shifts in zip(rows, folded, row_shifts):
        if None in plans_of_row:
            shifts = [*shifts, *(p.microbatch * stride for a in row for p in a.parts)]
        if shifts:
            low, high = min(low, min(shifts)), max(high, max(shifts))
    if high - low > (4 * sum(map(len, rows)) + 16) * stride:
        return 0, SparseValues()
    return low, [None] * (high - low + stride)


def known_values(produced: list[float | None] | SparseValues, base: int) -> dict[int, float]:
    """``produced`` as a dict by value: what deadlock reports and ``PairPlans`` read."""
    if isinstance(produced, dict):
        return produced
    return {i + base: t for i, t in enumerate(produced) if t is not None}
