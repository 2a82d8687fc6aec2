"""Lowering: an ordered list of named passes from a compute-only program to a runnable one.

The one pass today, ``inject_comms``, adds a SEND/RECV pair for every value that crosses ranks
(``deps.crosses_ranks``). It walks the ranks' compute lists together, round-robin, as a single
global sequence: a compute action is appended once every value it needs is on its rank, and each
value it produces for another rank is appended right away as a SEND on this rank and the matching
RECV on the receiver, adjacent in the global sequence. Hence:

* every rank's SENDs follow their producers and every RECV precedes its consumer;
* for any two ranks, transfers between them appear in the same order on both ends (NCCL's
  per-peer stream never crosses, Megatron #5100);
* executing ranks in the global order completes with blocking (rendezvous) P2P — the first
  unexecuted action of that order is always runnable — and so also with batched P2P.

If the walk stalls, the program cannot run: ``ScheduleError`` names each rank, the action it is
stuck at and what it waits for, and draws the grid. This is the same check ``validate`` relies on,
in the style of d9d's comm injection (DESIGN.md habit 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipetrain.schedule import deps
from pipetrain.schedule.action import Action
from pipetrain.schedule.program import Program, ScheduleError


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Program], Program]


def inject_comms(program: Program) -> Program:
    """Add SEND/RECV actions for every cross-rank dependency (see the module docstring)."""
    if program.is_lowered:
        raise ScheduleError("program already carries SEND/RECV actions; lower a compute-only one")
    placement = program.placement
    num_stages = placement.num_stages
    rows = program.actions
    out: list[list[Action]] = [[] for _ in rows]
    available: list[set[deps.Key]] = [set() for _ in rows]
    pos = [0] * len(rows)
    remaining = sum(len(r) for r in rows)
    while remaining:
        progressed = False
        for rank, row in enumerate(rows):
            # One action per rank per round keeps the global order close to unit-time order, so
            # receives are not posted far ahead of when they are needed.
            if pos[rank] < len(row):
                action = row[pos[rank]]
                have = available[rank]
                if not all(k in have for k in deps.requires(action, num_stages)):
                    continue
                out[rank].append(action)
                pos[rank] += 1
                remaining -= 1
                progressed = True
                for key in deps.produces(action):
                    have.add(key)
                    if deps.crosses_ranks(key, placement):
                        send, recv = deps.transfer(key)
                        dst = placement.rank(recv.stage)
                        out[rank].append(send)
                        out[dst].append(recv)
                        available[dst].add(key)
        if not progressed:
            raise deadlock_error(program, pos, available)
    return program.with_actions(out)


def deadlock_error(
    program: Program, pos: Sequence[int], available: Sequence[set[deps.Key]]
) -> ScheduleError:
    """Describe who waits on whom when no rank can move."""
    placement = program.placement
    lines, marked = [], []
    for rank, row in enumerate(program.actions):
        if pos[rank] >= len(row):
            continue
        action = row[pos[rank]]
        missing = [k for k in deps.requires(action, program.num_stages) if k not in available[rank]]
        waits = ", ".join(_describe(k, placement) for k in missing) or "nothing (bug)"
        lines.append(f"  rank {rank} step {pos[rank]}: {action} waits for {waits}")
        marked.append((rank, pos[rank]))
    return ScheduleError(
        "deadlock: no rank can make progress\n" + "\n".join(lines), program, marked
    )


def _describe(key: deps.Key, placement) -> str:
    token, stage, mb = key
    producer = {
        deps.Token.ACTIVATION: "F",
        deps.Token.INPUT_GRAD: "B/I",
        deps.Token.WEIGHT_GRAD: "W",
    }[token]
    if not 0 <= stage < placement.num_stages:
        return f"{producer} of stage {stage} (no such stage)"
    return f"{stage}{producer}{mb} on rank {placement.rank(stage)}"


PASSES: tuple[Pass, ...] = (Pass("inject_comms", inject_comms),)


def lower(program: Program, passes: Sequence[Pass] = PASSES) -> Program:
    """Apply the passes in order. A program that already has comms is returned as it is."""
    if program.is_lowered:
        return program
    for p in passes:
        program = p.run(program)
    return program
