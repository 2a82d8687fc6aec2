"""Dependency-order execution of a program: the one event loop behind lowering, validation and
the simulator.

Each rank runs its compute actions in order, one at a time; an action starts when its rank is free
and every value it needs (``deps.requires``) has arrived — ``latency(key)`` after its producer
ended when producer and consumer live on different ranks. A rank that waits is parked on the
missing value and woken when it is produced, so a run is O(actions) however long the program.
If ranks remain parked when nothing is left to run, the program deadlocks and ``ScheduleError``
says who waits on whom.

The loop reads the rule through ``deps.compile_rule`` (values as integers), because it runs once
per action of every lowering, validation and simulation.
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
    rule = deps.compile_rule(program.placement)
    needs_of, makes_of, stride = rule.needs, rule.makes, rule.stride
    pay_latency = latency is not _no_latency  # lowering and validation: no call per dependency
    rows = [[a for a in row if a.is_compute] for row in program.actions]
    produced: dict[int, float] = {}  # value -> when it was produced
    waiting: dict[int, list[int]] = {}  # value -> ranks parked on it
    pos = [0] * len(rows)
    free_at = [0.0] * len(rows)
    spans: list[Span] = []
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        row, step, free = rows[rank], pos[rank], free_at[rank]
        while step < len(row):
            action = row[step]
            parts = action.compute_parts
            start = free
            blocked_on = None
            for part in parts:
                shift = part.microbatch * stride
                needs = needs_of.get((part.kind, part.stage))
                if needs is None:  # unvalidated input naming a stage the placement lacks
                    raise _bad_stage(program, rows, rank, step)
                for base, producer_rank, token, stage in needs:
                    t = produced.get(base + shift)
                    if t is None:
                        blocked_on = base + shift
                        break
                    if producer_rank != rank and pay_latency:
                        t += latency((token, stage, part.microbatch))
                    if t > start:
                        start = t
                if blocked_on is not None:
                    break
            if blocked_on is not None:
                waiting.setdefault(blocked_on, []).append(rank)
                break
            free = start + duration(action)
            spans.append(Span(rank, action, start, free))
            step += 1
            for part in parts:
                shift = part.microbatch * stride
                for base in makes_of[part.kind, part.stage]:
                    produced[base + shift] = free
                    if base + shift in waiting:
                        work.extend(waiting.pop(base + shift))
        pos[rank], free_at[rank] = step, free
    if any(p < len(r) for p, r in zip(pos, rows)):
        produced_keys = {rule.key(v): t for v, t in produced.items()}
        raise deadlock_error(program.with_actions(rows), pos, produced_keys)
    return spans


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
