"""Lowering: an ordered list of named passes from a compute-only program to a runnable one.

The one pass today, ``inject_comms``, adds a SEND/RECV pair for every value that crosses ranks
(``deps.crosses_ranks``). It first runs the program in dependency order with unit durations
(``execute``), which yields one global, time-ordered sequence of every rank's actions; each value
produced for another rank becomes a SEND right after its producer and the matching RECV on the
receiver at the same instant, adjacent in that sequence. Hence:

* every SEND follows its producer and every RECV precedes its consumer, and receives sit where the
  unit-time run says the value arrives — early, so the runtime can post them ahead of need;
* for any two ranks, transfers between them appear in the same order on both ends (NCCL's
  per-peer stream never crosses, the hang of Megatron #5100);
* executing in the global order completes with blocking (rendezvous) P2P — the first unexecuted
  action of that order is always runnable — and so also with batched P2P.

A program that cannot run raises ``ScheduleError`` naming who waits on whom (d9d injects comms
the same way, DESIGN.md habit 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetrain.schedule import deps
from pipetrain.schedule.action import Action
from pipetrain.schedule.execute import execute
from pipetrain.schedule.program import Program, ScheduleError


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Program], Program]


def _unit(_: Action) -> float:
    return 1.0


def inject_comms(program: Program) -> Program:
    """Add SEND/RECV actions for every cross-rank dependency (see the module docstring)."""
    if program.is_lowered:
        raise ScheduleError("program already carries SEND/RECV actions; lower a compute-only one")
    transfers_of = deps.compile_rule(program.placement).transfers
    # Entries sort by (time, 0 = transfer before 1 = compute, rank, execution order); the running
    # count as fourth field makes every entry distinct, so the sort never compares actions.
    entries: list[tuple[float, int, int, int, Action, Action | None, int]] = []
    for span in execute(program, _unit):
        rank, action = span.rank, span.action
        entries.append((span.start, 1, rank, len(entries), action, None, rank))
        for part in action.compute_parts:
            for t in transfers_of[part.kind, part.stage]:  # templates at micro-batch 0
                send = Action(t.send.kind, t.send.stage, part.microbatch)
                recv = Action(t.recv.kind, t.recv.stage, part.microbatch)
                entries.append((span.end, 0, rank, len(entries), send, recv, t.recv_rank))
    entries.sort()
    rows: list[list[Action]] = [[] for _ in range(program.num_ranks)]
    for _, _, rank, _, action, recv, recv_rank in entries:
        rows[rank].append(action)
        if recv is not None:
            rows[recv_rank].append(recv)
    return program.with_actions(rows)


PASSES: tuple[Pass, ...] = (Pass("inject_comms", inject_comms),)


def lower(program: Program, passes: Sequence[Pass] = PASSES) -> Program:
    """Apply the passes in order. A program that already has comms is returned as it is."""
    if program.is_lowered:
        return program
    for p in passes:
        program = p.run(program)
    return program
