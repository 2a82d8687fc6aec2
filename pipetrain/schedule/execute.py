"""Dependency-order execution of a program: the one event loop behind lowering, validation and
the simulator.

Each rank runs its compute actions in order, one at a time; an action starts when its rank is free
and every value it needs (``deps.requires``) has arrived — ``latency(key)`` after its producer
ended when producer and consumer live on different ranks. A rank that waits is parked on the
missing value and woken when it is produced, so a run is O(actions) however long the program.
If ranks remain parked when nothing is left to run, the program deadlocks and ``ScheduleError``
says who waits on whom.

The loop runs once per action of every lowering, validation and simulation, so it reads the rule
through ``deps.compile_rule`` (values as integers) and asks ``duration`` and ``latency`` up front,
once per (kind, stage) at micro-batch 0, into one plan per (kind, stage): a plain action costs two
table subscripts, not a call per action and another per dependency.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter

from pipetrain.schedule import deps
from pipetrain.schedule.action import COMPUTE_KINDS, Action, OpKind
from pipetrain.schedule.placement import Placement
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.timeline import Span

#: what a (kind, stage) needs — (value, producer's rank, latency) each —, the values it produces
#: that others await (``deps.CompiledRule.awaited``), and what it costs
Plan = tuple[tuple[tuple[int, int, float], ...], tuple[int, ...], float]


@dataclass(frozen=True, slots=True)
class Run:
    """A finished run: each rank's compute actions with their times, and the execution order.

    Times are kept per rank (no object per action) because lowering reads them row by row;
    ``spans`` lays them out in execution order for a ``Timeline``.
    """

    rows: list[list[Action]]
    starts: list[list[float]]
    ends: list[list[float]]
    #: (rank, first step, end step) for each stretch a rank ran without waiting, in order
    stretches: list[tuple[int, int, int]]

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
) -> Run:
    """``execute``, with the times left per rank (see ``Run``)."""
    rule = deps.compile_rule(program.placement)
    stride = rule.stride
    plans = _plans(rule, duration, latency)
    pairs = _PairPlans(plans, stride, duration)
    rows = [[a for a in row if a.kind in COMPUTE_KINDS] for row in program.actions]
    produced: dict[int, float] = {}  # value -> when it was produced
    waiting: dict[int, list[int]] = {}  # value -> ranks parked on it
    pos = [0] * len(rows)
    free_at = [0.0] * len(rows)
    starts: list[list[float]] = [[] for _ in rows]
    ends: list[list[float]] = [[] for _ in rows]
    stretches: list[tuple[int, int, int]] = []
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        row, step, free = rows[rank], pos[rank], free_at[rank]
        rank_starts, rank_ends = starts[rank], ends[rank]
        first = step
        while step < len(row):
            action = row[step]
            if action.parts:
                plan = pairs.plan(action, produced)
                shift = 0  # a pair's plan holds its parts' own values
            else:
                plan = plans[action.kind].get(action.stage)
                shift = action.microbatch * stride
            if plan is None:  # unvalidated input naming a stage the placement lacks
                raise _bad_stage(program, rows, rank, step)
            needs, awaited, cost = plan
            start = free
            for value, producer_rank, delay in needs:
                arrived = produced.get(value + shift)
                if arrived is None:
                    break  # park on the first missing value (below)
                if producer_rank != rank:
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
            stretches.append((rank, first, step))
        pos[rank], free_at[rank] = step, free
    if any(p < len(r) for p, r in zip(pos, rows)):
        produced_keys = {rule.key(v): t for v, t in produced.items()}
        raise deadlock_error(program.with_actions(rows), pos, produced_keys)
    return Run(rows, starts, ends, stretches)


def _plans(
    rule: deps.CompiledRule,
    duration: Callable[[Action], float],
    latency: Callable[[deps.Key], float],
) -> dict[OpKind, dict[int, Plan]]:
    """``[kind][stage]`` -> the plain action's plan at micro-batch 0 (every kind has a dict)."""
    plans: dict[OpKind, dict[int, Plan]] = {kind: {} for kind in OpKind}
    for kind, needs_of_stage in rule.needs.items():
        for stage, needs in needs_of_stage.items():
            plans[kind][stage] = (
                tuple(
                    (value, producer_rank, latency((token, producer_stage, 0)))
                    for value, producer_rank, token, producer_stage in needs
                ),
                rule.awaited[kind][stage],
                duration(Action(kind, stage, 0)),
            )
    return plans


class _PairPlans:
    """Plans of overlapped pairs, made as the loop meets them: each part's values shifted to its
    own micro-batch. ``duration`` is asked once per pair shape (the pair's stage and its parts'
    kinds and stages), since a DualPipe program is mostly pairs."""

    def __init__(
        self,
        plans: dict[OpKind, dict[int, Plan]],
        stride: int,
        duration: Callable[[Action], float],
    ) -> None:
        self.plans, self.stride, self.duration = plans, stride, duration
        self.costs: dict[tuple[int, tuple[tuple[OpKind, int], ...]], float] = {}

    def plan(self, pair: Action, produced: dict[int, float]) -> Plan | None:
        """The pair's plan; for a part naming a stage the placement lacks (unvalidated input),
        see ``_bad_part``."""
        needs: list[tuple[int, int, float]] = []
        awaited: list[int] = []
        for part in pair.parts:
            plan = self.plans[part.kind].get(part.stage)
            if plan is None:
                return _bad_part(needs, produced)
            shift = part.microbatch * self.stride
            for value, producer_rank, delay in plan[0]:
                needs.append((value + shift, producer_rank, delay))
            for value in plan[1]:
                awaited.append(value + shift)
        shape = (pair.stage, tuple(map(_kind_and_stage, pair.parts)))
        cost = self.costs.get(shape)
        if cost is None:
            cost = self.costs[shape] = self.duration(pair)
        return tuple(needs), tuple(awaited), cost


_kind_and_stage = attrgetter("kind", "stage")


def _bad_part(needs: list[tuple[int, int, float]], produced: dict[int, float]) -> Plan | None:
    """A pair with a part on a stage the placement lacks. Checked part by part, that fails only
    once every earlier part's inputs are there: then the answer is None; before, the pair waits on
    the missing input, so its plan is the earlier parts' needs, and it never runs."""
    if all(value in produced for value, _, _ in needs):
        return None
    return tuple(needs), (), 0.0


def _bad_stage(
    program: Program, rows: Sequence[Sequence[Action]], rank: int, step: int
) -> ScheduleError:
    return ScheduleError(
        f"rank {rank} step {step}: {rows[rank][step]} names a stage outside "
        f"0..{program.num_stages - 1}",
        program.with_actions(rows),
        [(rank, step)],
    )


def deadlock_error(
    program: Program, pos: Sequence[int], produced: dict[deps.Key, float]
) -> ScheduleError:
    """Describe who waits on whom when no rank can move; ``program`` is compute only."""
    placement = program.placement
    lines, marked = [], []
    for rank, row in enumerate(program.actions):
        if pos[rank] >= len(row):
            continue
        action = row[pos[rank]]
        missing = [
            k
            for k in deps.requires(action, program.placement.stages_per_chain)
            if k not in produced
        ]
        waits = ", ".join(describe_key(k, placement) for k in missing)
        lines.append(f"  rank {rank} step {pos[rank]}: {action} waits for {waits}")
        marked.append((rank, pos[rank]))
    return ScheduleError(
        "deadlock: no rank can make progress\n" + "\n".join(lines), program, marked
    )


def describe_key(key: deps.Key, placement: Placement) -> str:
    """``1B/I3 on rank 1``: the action that produces a value, and where."""
    token, stage, mb = key
    producer = {
        deps.Token.ACTIVATION: "F",
        deps.Token.INPUT_GRAD: "B/I",
        deps.Token.WEIGHT_GRAD: "W",
    }[token]
    return f"{stage}{producer}{mb} on rank {placement.rank(stage)}"
