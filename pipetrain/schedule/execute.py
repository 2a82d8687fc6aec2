"""Dependency-order execution of a program: the one event loop behind lowering, validation and
the simulator.

Each rank runs its compute actions in order, one at a time; an action starts when its rank is free
and every value it needs (``deps.requires``) has arrived — ``latency(key)`` after its producer
ended when producer and consumer live on different ranks. A rank that waits is parked on the
missing value and woken when it is produced, so a run is O(actions) however long the program.
If ranks remain parked when nothing is left to run, the program deadlocks and ``ScheduleError``
says who waits on whom.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pipetrain.schedule import deps
from pipetrain.schedule.action import Action
from pipetrain.schedule.placement import Placement
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.timeline import Span


def _no_latency(_: deps.Key) -> float:
    return 0.0


def execute(
    program: Program,
    duration: Callable[[Action], float],
    latency: Callable[[deps.Key], float] = _no_latency,
) -> list[Span]:
    """Run the program's compute actions (SEND/RECV are skipped: they are latency, not work)."""
    placement, num_stages = program.placement, program.num_stages
    rows = [tuple(a for a in row if a.is_compute) for row in program.actions]
    rank_of_stage = placement.rank_of_stage
    produced: dict[deps.Key, float] = {}
    waiting: dict[deps.Key, list[int]] = {}
    pos = [0] * len(rows)
    free_at = [0.0] * len(rows)
    spans: list[Span] = []
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        row = rows[rank]
        while pos[rank] < len(row):
            action = row[pos[rank]]
            start = free_at[rank]
            blocked_on = None
            for key in deps.requires(action, num_stages):
                t = produced.get(key)
                if t is None:
                    blocked_on = key
                    break
                if rank_of_stage[key[1]] != rank:
                    t += latency(key)
                if t > start:
                    start = t
            if blocked_on is not None:
                waiting.setdefault(blocked_on, []).append(rank)
                break
            end = start + duration(action)
            spans.append(Span(rank, action, start, end))
            free_at[rank] = end
            pos[rank] += 1
            for key in deps.produces(action):
                produced[key] = end
                if key in waiting:
                    work.extend(waiting.pop(key))
    if any(p < len(r) for p, r in zip(pos, rows)):
        raise deadlock_error(program.with_actions(rows), pos, produced)
    return spans


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
        missing = [k for k in deps.requires(action, program.num_stages) if k not in produced]
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
