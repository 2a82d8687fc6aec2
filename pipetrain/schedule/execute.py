"""Dependency-order execution of a program: the one event loop behind lowering, validation and
the simulator.

Each rank runs its compute actions in order, one at a time; an action starts when its rank is free
and every value it needs (``deps.requires``) has arrived — ``latency(key)`` after its producer
ended when producer and consumer live on different ranks. A rank that waits is parked on the
missing value and woken when it is produced, so a run is O(actions) however long the program.
If ranks remain parked when nothing is left to run, the program deadlocks and ``ScheduleError``
says who waits on whom. A program's OFFLOAD/RELOAD copies run beside compute on each rank's copy
engine (``copy_engine`` states that model); a backward waits for its reload.

An eager GPU rank is two workers: the host issues its actions one after another, never waiting
for a transfer (the device waits for those), and the device runs each action's kernels as they
come. With ``issue`` (each action's host time and its device time when its kernels are queued
ahead), an action's kernels start when the device is free, its inputs are there and the host has
begun issuing it, and it ends ``device`` after its start or ``duration`` (its time from an idle
start, host and device together) after the host began it, whichever is later: a host slower than
the device makes the device wait, and a device behind the host hides the host's time. Without
``issue`` the host costs nothing and the device takes ``duration``: the plain model. With
``scale`` (a factor per action: micro-batches of unequal work, e.g. packed documents) an action's
device time and its time from an idle start are its plan's times that factor; its host time is
not (the host issues the same kernels whatever the work).

The loop runs once per action of every lowering, validation and simulation, so it reads the rule
through ``deps.compile_rule`` (values as integers) and asks ``duration`` and ``latency`` up front,
once per (kind, stage) at micro-batch 0, into one plan per (kind, stage): a plain action costs two
table subscripts, not a call per action and another per dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter, is_, mul
from typing import Any, NamedTuple

from pipetrain.schedule import deps
from pipetrain.schedule.action import COMPUTE_KINDS, COPY_KINDS, Action, OpKind
from pipetrain.schedule.copy_engine import CopyEngine, CopyPlan
from pipetrain.schedule.placement import Placement
from pipetrain.schedule.plans import (
    Issue,
    PairPlans,
    Plan,
    SparseValues,
    compile_plans,
    known_values,
    pair_shape,
    value_table,
)
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.timeline import Span

_kind = attrgetter("kind")
_kind_stage = attrgetter("kind", "stage")
_stage = attrgetter("stage")
_microbatch = attrgetter("microbatch")
_NON_COMPUTE = frozenset(OpKind) - COMPUTE_KINDS
#: ``Stretch._make`` without its Python-level call: a run makes one per wait, ~10^5
_new_tuple = tuple.__new__


class Stretch(NamedTuple):
    """Steps ``first`` to ``end`` (exclusive) of ``rank``'s row, run without waiting."""

    rank: int
    first: int
    end: int


class Wait(NamedTuple):
    """A rank stuck at ``step`` on ``action``, and what it waits for, in words."""

    rank: int
    step: int
    action: Action
    waits_for: str


@dataclass(frozen=True, slots=True)
class Run:
    """A finished run: each rank's compute actions with their times, and the execution order.

    Times are kept per rank (no object per action) because lowering reads them row by row;
    ``spans`` lays them out in execution order for a ``Timeline``.
    """

    rows: list[list[Action]]
    starts: list[list[float]]
    ends: list[list[float]]
    #: each stretch a rank ran without waiting, in order
    stretches: list[Stretch]
    #: the OFFLOAD/RELOAD copies, on the copy engine beside compute (``copy_engine``)
    copies: tuple[Span, ...] = ()
    #: with ``issue``: when each rank's host began and ended issuing each action
    host: tuple[Span, ...] = ()

    def spans(self) -> list[Span]:
        spans: list[Span] = []
        for rank, first, end in self.stretches:
            fields = zip(
                repeat(rank, end - first),
                self.rows[rank][first:end],
                self.starts[rank][first:end],
                self.ends[rank][first:end],
            )
            # ``tuple.__new__(Span, fields)`` is what ``Span._make`` does, without a Python call
            # per span (a simulation makes 10^5 of them)
            spans += map(tuple.__new__, repeat(Span), fields)
        return spans


def _no_latency(_: deps.Key) -> float:
    return 0.0


def unit_duration(_: Action) -> float:
    """Every action lasts 1: the order-only run that lowering and validation use."""
    return 1.0


def execute(
    program: Program,
    duration: Callable[[Action], float],
    latency: Callable[[deps.Key], float] = _no_latency,
) -> list[Span]:
    """Run the program's compute actions (SEND/RECV are skipped: they are latency, not work).

    ``duration`` and ``latency`` may depend on kinds (tokens) and stages only, not micro-batches:
    they are asked once per stage at micro-batch 0, and an overlapped pair's duration once per
    combination of its stage and its parts' kinds and stages.
    """
    return run(program, duration, latency).spans()


def run(
    program: Program,
    duration: Callable[[Action], float],
    latency: Callable[[deps.Key], float] = _no_latency,
    copy_plan: Callable[[int], CopyPlan] | None = None,
    issue: Issue | None = None,
    scale: Callable[[Action], float] | None = None,
) -> Run:
    """``execute`` with the times left per rank (``Run``); ``copy_plan``: how each stage's copies
    run (``None``: each lasts its ``duration``); ``issue``, ``scale``: the module docstring."""
    rule = deps.compile_rule(program.placement)
    plans = compile_plans(rule, duration, latency, issue)
    pairs = PairPlans(plans, rule.stride, duration, issue)
    kinds = [set(map(_kind, row)) for row in program.actions]  # each row's kinds, read in C
    rows = _compute_rows(program, kinds)
    has_copies = any(not COPY_KINDS.isdisjoint(of_row) for of_row in kinds)
    copies = CopyEngine(program.actions, duration, copy_plan) if has_copies else None
    row_shifts = [list(map(mul, map(_microbatch, row), repeat(rule.stride))) for row in rows]
    if copies is None and issue is None and scale is None and _at_home(program, rows):
        folded = _folded_rows(program, rows, plans, pairs)
        base, produced = value_table(rows, folded, row_shifts, rule.stride)
        shifted = (
            [[shift - base for shift in shifts] for shifts in row_shifts] if base else row_shifts
        )
        played = _play_plain(program, rows, folded, shifted, pairs, produced, base)
    else:
        base = 0
        row_plans = _row_plans(rows, plans)
        row_factors = None if scale is None else [list(map(scale, row)) for row in rows]
        played = _play(program, rows, row_plans, row_shifts, row_factors, pairs, copies)
    starts, ends, stretches, pos, produced = played
    if any(p < len(r) for p, r in zip(pos, rows)):
        stuck = _stuck_computes(program, rows, pos, known_values(produced, base))
        raise deadlock_error(program.with_actions(rows), stuck)
    spans = tuple(copies.spans) if copies else ()
    return Run(rows, starts, ends, stretches, spans, _host_spans(rows, issue))


class _Played(NamedTuple):
    """What a play of the loop leaves: per rank its starts and ends, the stretches in order, how
    far each rank got, and when each value was produced."""

    starts: list[list[float]]
    ends: list[list[float]]
    stretches: list[Stretch]
    pos: list[int]
    #: a dict, or ``_play_plain``'s table (``plans.value_table``)
    produced: Any


def _row_plans(
    rows: Sequence[Sequence[Action]], plans: dict[OpKind, dict[int, Plan]]
) -> list[list[Plan | None]]:
    """Each row's plans, read in C (``map``) before the loop, so that the loop pays a list
    subscript per action, not attribute reads and dict lookups. A pair's plan (None here) is
    found as the loop meets it; so is an unknown stage's error."""
    flat = {
        (kind, stage): plan for kind, of_stage in plans.items() for stage, plan in of_stage.items()
    }
    return [list(map(flat.get, map(_kind_stage, row))) for row in rows]


def _at_home(program: Program, rows: Sequence[Sequence[Action]]) -> bool:
    """Whether every plain action's stage lives on the rank whose row holds it (validated
    programs; ``_play_plain`` counts a value's latency by its producer's home rank)."""
    stages_of_rank: list[set[int]] = [set() for _ in rows]
    for stage, rank in enumerate(program.placement.rank_of_stage):
        stages_of_rank[rank].add(stage)
    return all(mine.issuperset(map(_stage, row)) for mine, row in zip(stages_of_rank, rows))


def _play(
    program: Program,
    rows: list[list[Action]],
    row_plans: list[list[Plan | None]],
    row_shifts: list[list[int]],
    row_factors: list[list[float]] | None,
    pairs: PairPlans,
    copies: CopyEngine | None,
) -> _Played:
    """The loop with every feature: hosts, copies, per-micro-batch factors (module docstring)."""
    produced: dict[int, float] = {}  # value -> when it was produced
    waiting: dict[int, list[int]] = {}  # value -> ranks parked on it
    pos = [0] * len(rows)
    free_at = [0.0] * len(rows)
    host_at = [0.0] * len(rows)  # when each rank's host begins issuing its next action
    starts: list[list[float]] = [[] for _ in rows]
    ends: list[list[float]] = [[] for _ in rows]
    stretches: list[Stretch] = []
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        row, step, free, issued = rows[rank], pos[rank], free_at[rank], host_at[rank]
        plans_of_row, shifts = row_plans[rank], row_shifts[rank]
        factors = None if row_factors is None else row_factors[rank]
        rank_starts, rank_ends = starts[rank], ends[rank]
        first, size = step, len(row)
        while step < size:
            plan = plans_of_row[step] or _pair_plan(program, rows, rank, step, pairs, produced)
            if copies is not None:
                copies.issue(rank, step, free)
            shift = shifts[step]
            needs, awaited, cost, host, device = plan
            start = free if free > issued else issued
            for value, producer_rank, delay in needs:
                arrived = produced.get(value + shift)
                if arrived is None:
                    break  # park on the first missing value (below)
                if producer_rank != rank:
                    arrived += delay
                if arrived > start:
                    start = arrived
            else:  # every input is here: run it
                if copies is not None:
                    start = copies.ready(row[step], start)
                if factors is not None:
                    cost, device = cost * factors[step], device * factors[step]
                free = start + device
                if issued + cost > free:
                    free = issued + cost
                issued += host
                rank_starts.append(start)
                rank_ends.append(free)
                step += 1
                for value in awaited:
                    value += shift
                    produced[value] = free
                    if value in waiting:
                        work.extend(waiting.pop(value))
                continue
            waiting.setdefault(value + shift, []).append(rank)
            break
        if copies is not None and step == size:
            copies.issue(rank, step, free)
        if step > first:
            stretches.append(_new_tuple(Stretch, (rank, first, step)))
        pos[rank], free_at[rank], host_at[rank] = step, free, issued
    return _Played(starts, ends, stretches, pos, produced)


#: a plan as ``_play_plain`` reads it: (needs as (value, latency), awaited values, duration)
Folded = tuple[tuple[tuple[int, float], ...], tuple[int, ...], float]


def _folded_rows(
    program: Program,
    rows: Sequence[Sequence[Action]],
    plans: dict[OpKind, dict[int, Plan]],
    pairs: PairPlans,
) -> list[list[Folded | None]]:
    """Each row's plans for ``_play_plain``, folded (``_fold``) on their stage's rank; an
    overlapped pair's too where every part names a known stage. Only an unknown stage is left
    None, for the loop to report (``_pair_plan``)."""
    home = program.placement.rank_of_stage
    flat = {
        (kind, stage): _fold(plan, home[stage])
        for kind, of_stage in plans.items()
        for stage, plan in of_stage.items()
    }
    # (``pair_shape``, rank) -> the pair's plan folded there; None: a part's stage is unknown
    of_pair: dict[tuple[tuple[object, ...], int], Folded | None] = {}
    out = []
    for rank, row in enumerate(rows):
        folded = list(map(flat.get, map(_kind_stage, row)))
        if None in folded:
            for step in compress(range(len(row)), map(is_, folded, repeat(None))):
                action = row[step]
                if not action.parts:
                    continue
                key = (pair_shape(action), rank)
                if key not in of_pair:
                    known = all((p.kind, p.stage) in flat for p in action.parts)
                    plan = pairs.plan(action, {}) if known else None
                    of_pair[key] = None if plan is None else _fold(plan, rank)
                folded[step] = of_pair[key]
        out.append(folded)
    return out


def _play_plain(
    program: Program,
    rows: list[list[Action]],
    row_plans: list[list[Folded | None]],
    row_shifts: list[list[int]],
    pairs: PairPlans,
    produced: list[float | None] | SparseValues,
    base: int,
) -> _Played:
    """``_play`` for the plain model (no host, no copies, no factors) with every action on its
    stage's rank: the same times, with a latency of 0 folded into each need that stays on its
    rank (``x + 0.0`` is ``x``), so the loop reads fewer fields per action. It runs every
    simulation the planner makes and every lowering and validation. ``produced`` holds each
    value's time at the value less ``base`` (``plans.value_table``; ``row_shifts`` are less it too)."""
    waiting: dict[int, list[int]] = {}  # value -> ranks parked on it
    pos = [0] * len(rows)
    free_at = [0.0] * len(rows)
    starts: list[list[float]] = [[] for _ in rows]
    ends: list[list[float]] = [[] for _ in rows]
    stretches: list[Stretch] = []
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        step, free, shifts = pos[rank], free_at[rank], row_shifts[rank]
        plans_of_row, rank_starts, rank_ends = row_plans[rank], starts[rank], ends[rank]
        first, size = step, len(plans_of_row)
        while step < size:
            fold = plans_of_row[step]
            if fold is None:
                known = known_values(produced, base)
                fold = _fold(_pair_plan(program, rows, rank, step, pairs, known), rank)
            needs, awaited, cost = fold
            shift = shifts[step]
            start = free
            for value, delay in needs:
                arrived = produced[value + shift]
                if arrived is None:
                    break  # park on the first missing value (below)
                arrived += delay
                if arrived > start:
                    start = arrived
            else:  # every input is here: run it
                free = start + cost
                rank_starts.append(start)
                rank_ends.append(free)
                step += 1
                for value in awaited:
                    value += shift
                    produced[value] = free
                    if value in waiting:
                        work.extend(waiting.pop(value))
                continue
            waiting.setdefault(value + shift, []).append(rank)
            break
        if step > first:
            stretches.append(_new_tuple(Stretch, (rank, first, step)))
        pos[rank], free_at[rank] = step, free
    return _Played(starts, ends, stretches, pos, produced)


def _fold(plan: Plan, rank: int) -> tuple[tuple[tuple[int, float], ...], tuple[int, ...], float]:
    """``plan`` on ``rank`` for ``_play_plain``: each need's latency, 0 where it stays on the rank."""
    needs = tuple(
        (value, delay if producer_rank != rank else 0.0)
        for value, producer_rank, delay in plan.needs
    )
    return needs, plan.awaited, plan.device


def _pair_plan(
    program: Program,
    rows: Sequence[Sequence[Action]],
    rank: int,
    step: int,
    pairs: PairPlans,
    produced: dict[int, float],
) -> Plan:
    """The plan of the action with none in its row's table: an overlapped pair's, or (unvalidated
    input naming a stage the placement lacks) ``ScheduleError``."""
    action = rows[rank][step]
    plan = pairs.plan(action, produced) if action.parts else None
    if plan is None:
        raise _bad_stage(program, rows, rank, step)
    return plan


def _compute_rows(program: Program, kinds: Sequence[set[OpKind]]) -> list[list[Action]]:
    """Each rank's compute actions, in order, picked in C (a row whose ``kinds`` are all
    compute is copied whole)."""
    return [
        list(row)
        if _NON_COMPUTE.isdisjoint(of_row)
        else list(compress(row, map(COMPUTE_KINDS.__contains__, map(_kind, row))))
        for row, of_row in zip(program.actions, kinds)
    ]


def _host_spans(rows: Sequence[Sequence[Action]], issue: Issue | None) -> tuple[Span, ...]:
    """When each rank's host began and ended issuing each action: one after another from 0,
    since a host never waits (the module docstring); none without ``issue``."""
    if issue is None:
        return ()
    spans = []
    for rank, row in enumerate(rows):
        issued = 0.0
        for action in row:
            host = issue(action)[0]
            spans.append(Span(rank, action, issued, issued + host))
            issued += host
    return tuple(spans)


def _bad_stage(
    program: Program, rows: Sequence[Sequence[Action]], rank: int, step: int
) -> ScheduleError:
    return ScheduleError(
        f"rank {rank} step {step}: {rows[rank][step]} names a stage outside "
        f"0..{program.num_stages - 1}",
        program.with_actions(rows),
        [(rank, step)],
    )


def deadlock_error(program: Program, waits: Sequence[Wait]) -> ScheduleError:
    """No rank can move: say who waits on whom, and mark each stuck cell of ``program``."""
    lines = [f"  rank {w.rank} step {w.step}: {w.action} waits for {w.waits_for}" for w in waits]
    return ScheduleError(
        "deadlock: no rank can make progress\n" + "\n".join(lines),
        program,
        [(w.rank, w.step) for w in waits],
    )


def _stuck_computes(
    program: Program,
    rows: Sequence[Sequence[Action]],
    pos: Sequence[int],
    produced: dict[int, float],
) -> list[Wait]:
    """Each stuck rank's next compute action and the values it lacks."""
    placement = program.placement
    rule = deps.compile_rule(placement)
    produced_keys = {rule.key(value) for value in produced}
    waits = []
    for rank, row in enumerate(rows):
        if pos[rank] < len(row):
            action = row[pos[rank]]
            missing = [
                k
                for k in deps.requires(action, placement.stages_per_chain)
                if k not in produced_keys
            ]
            where = ", ".join(describe_key(k, placement) for k in missing)
            waits.append(Wait(rank, pos[rank], action, where))
    return waits


def describe_key(key: deps.Key, placement: Placement) -> str:
    """``1B/I3 on rank 1``: the action that produces a value, and where."""
    token, stage, mb = key
    producer = {
        deps.Token.ACTIVATION: "F",
        deps.Token.INPUT_GRAD: "B/I",
        deps.Token.WEIGHT_GRAD: "W",
    }[token]
    return f"{stage}{producer}{mb} on rank {placement.rank(stage)}"
