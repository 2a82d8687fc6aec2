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
    placement = program.placement
    rank_of_stage = placement.rank_of_stage
    # (time, kind: 0 = transfer before 1 = compute, rank, sequence) orders the global sequence
    items: list[tuple[float, int, int, int, Action, Action | None]] = []
    for seq, span in enumerate(execute(program, _unit)):
        items.append((span.start, 1, span.rank, seq, span.action, None))
        for key in deps.produces(span.action):
            if deps.crosses_ranks(key, placement):
                send, recv = deps.transfer(key)
                items.append((span.end, 0, span.rank, seq, send, recv))
    items.sort(key=lambda item: item[:4])
    rows: list[list[Action]] = [[] for _ in range(program.num_ranks)]
    for _, _, rank, _, action, recv in items:
        rows[rank].append(action)
        if recv is not None:
            rows[rank_of_stage[recv.stage]].append(recv)
    return program.with_actions(rows)


PASSES: tuple[Pass, ...] = (Pass("inject_comms", inject_comms),)


def lower(program: Program, passes: Sequence[Pass] = PASSES) -> Program:
    """Apply the passes in order. A program that already has comms is returned as it is."""
    if program.is_lowered:
        return program
    for p in passes:
        program = p.run(program)
    return program
