"""Validation: is a program complete, placed right, paired and runnable?

``validate`` checks, in order, and raises ``ScheduleError`` (grid drawn, bad cells marked) at the
first failure:

1. every action's stage and micro-batch exist and the stage lives on the action's rank;
2. each (stage, micro-batch) has exactly one ``F`` and either one ``B`` or one ``I`` and one ``W``;
3. for a lowered program, every cross-rank value travels exactly once (one SEND on the producer's
   rank, one RECV on the consumer's) and nothing else is sent;
4. execution completes. A compute-only program runs on dependencies alone. A lowered program runs
   with *blocking batched* P2P: a run of consecutive SEND/RECV actions on a rank is posted at once,
   and the rank waits until each of them has its counterpart posted — what ``batch_isend_irecv``
   followed by ``wait`` does, and (with runs of length one) what blocking send/recv does.

The dependency rule is ``deps``; a deadlock reports each stuck rank, its action and what it waits
for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pipetrain.schedule import deps
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.lower import inject_comms
from pipetrain.schedule.program import Program, ScheduleError


def validate(program: Program) -> Program:
    """Raise ``ScheduleError`` if ``program`` is malformed or cannot run; return it otherwise."""
    _check_placement(program)
    _check_counts(program)
    if program.is_lowered:
        _check_pairing(program)
        _execute_lowered(program)
    else:
        inject_comms(program)  # the walk that injects comms is the dependency-order execution
    return program


def _cells(program: Program):
    for rank, row in enumerate(program.actions):
        for step, action in enumerate(row):
            yield rank, step, action


def _check_placement(program: Program) -> None:
    placement, m = program.placement, program.num_microbatches
    for rank, step, action in _cells(program):
        for part in action.compute_parts if action.is_compute else (action,):
            if not 0 <= part.stage < placement.num_stages:
                raise ScheduleError(
                    f"rank {rank} step {step}: {action} names stage {part.stage}; "
                    f"legal stages are 0..{placement.num_stages - 1}",
                    program,
                    [(rank, step)],
                )
            if not 0 <= part.microbatch < m:
                raise ScheduleError(
                    f"rank {rank} step {step}: {action} names micro-batch {part.microbatch}; "
                    f"legal micro-batches are 0..{m - 1}",
                    program,
                    [(rank, step)],
                )
            if placement.rank(part.stage) != rank:
                raise ScheduleError(
                    f"rank {rank} step {step}: {action} runs stage {part.stage}, which lives on "
                    f"rank {placement.rank(part.stage)}",
                    program,
                    [(rank, step)],
                )


def _check_counts(program: Program) -> None:
    where: dict[tuple[OpKind, int, int], list[tuple[int, int]]] = {}
    for rank, step, action in _cells(program):
        if action.is_compute:
            for p in action.compute_parts:
                where.setdefault((p.kind, p.stage, p.microbatch), []).append((rank, step))
    for stage in range(program.num_stages):
        for mb in range(program.num_microbatches):
            n = {
                k: len(where.get((k, stage, mb), ()))
                for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W)
            }
            cells = [c for k in n for c in where.get((k, stage, mb), ())]
            ok_full = n[OpKind.B] == 1 and n[OpKind.I] == n[OpKind.W] == 0
            ok_split = n[OpKind.B] == 0 and n[OpKind.I] == n[OpKind.W] == 1
            if n[OpKind.F] != 1 or not (ok_full or ok_split):
                found = ", ".join(f"{v} {k.value}" for k, v in n.items())
                raise ScheduleError(
                    f"stage {stage} micro-batch {mb} needs exactly one F and either one B or one I "
                    f"and one W; found {found}",
                    program,
                    cells,
                )


def _check_pairing(program: Program) -> None:
    placement = program.placement
    seen: Counter[Action] = Counter()
    cell: dict[Action, tuple[int, int]] = {}
    for rank, step, action in _cells(program):
        if action.is_comm:
            seen[action] += 1
            cell.setdefault(action, (rank, step))
    needed: set[Action] = set()
    for row in program.actions:
        for action in row:
            if action.is_compute:
                for key in deps.produces(action):
                    if deps.crosses_ranks(key, placement):
                        needed.update(deps.transfer(key))
    for action, count in seen.items():
        if action not in needed:
            raise ScheduleError(
                f"{action} moves a value that never crosses ranks (or does not exist)",
                program,
                [cell[action]],
            )
        if count > 1:
            raise ScheduleError(f"{action} appears {count} times", program, [cell[action]])
    missing = sorted(needed - set(seen), key=str)
    if missing:
        names = ", ".join(map(str, missing[:8])) + (" …" if len(missing) > 8 else "")
        raise ScheduleError(f"missing communication actions: {names}", program)


def _execute_lowered(program: Program) -> None:
    rows, num_stages = program.actions, program.num_stages
    have: list[set[deps.Key]] = [set() for _ in rows]
    posted: set[Action] = set()
    pos = [0] * len(rows)
    remaining = sum(len(r) for r in rows)
    while remaining:
        progressed = False
        for rank, row in enumerate(rows):
            if pos[rank] >= len(row):
                continue
            action = row[pos[rank]]
            if action.is_compute:
                if all(k in have[rank] for k in deps.requires(action, num_stages)):
                    have[rank].update(deps.produces(action))
                    pos[rank] += 1
                    remaining -= 1
                    progressed = True
                continue
            batch = _batch_at(row, pos[rank])
            for i, comm in enumerate(batch):
                if (
                    comm.kind in (OpKind.SEND_F, OpKind.SEND_B)
                    and deps.comm_key(comm) not in have[rank]
                ):
                    raise ScheduleError(
                        f"rank {rank} step {pos[rank] + i}: {comm} sends a value not yet computed here",
                        program,
                        [(rank, pos[rank] + i)],
                    )
                if comm not in posted:
                    posted.add(comm)
                    progressed = True
            if all(deps.peer(c) in posted for c in batch):
                for comm in batch:
                    if comm.kind in (OpKind.RECV_F, OpKind.RECV_B):
                        have[rank].add(deps.comm_key(comm))
                pos[rank] += len(batch)
                remaining -= len(batch)
                progressed = True
        if not progressed:
            raise _lowered_deadlock(program, pos, have, posted)


def _batch_at(row: Sequence[Action], start: int) -> tuple[Action, ...]:
    end = start
    while end < len(row) and row[end].is_comm:
        end += 1
    return tuple(row[start:end])


def _lowered_deadlock(
    program: Program, pos: Sequence[int], have: Sequence[set[deps.Key]], posted: set[Action]
) -> ScheduleError:
    placement = program.placement
    lines, marked = [], []
    for rank, row in enumerate(program.actions):
        if pos[rank] >= len(row):
            continue
        action = row[pos[rank]]
        if action.is_compute:
            missing = [k for k in deps.requires(action, program.num_stages) if k not in have[rank]]
            what = ", ".join(
                f"{k[1]}{'F' if k[0] is deps.Token.ACTIVATION else 'B/I'}{k[2]}" for k in missing
            )
            lines.append(f"  rank {rank} step {pos[rank]}: {action} waits for {what}")
            marked.append((rank, pos[rank]))
            continue
        for i, comm in enumerate(_batch_at(row, pos[rank])):
            other = deps.peer(comm)
            if other not in posted:
                peer_rank = placement.rank(other.stage)
                lines.append(
                    f"  rank {rank} step {pos[rank] + i}: {comm} waits for {other} on rank {peer_rank}"
                )
                marked.append((rank, pos[rank] + i))
    return ScheduleError(
        "deadlock: no rank can make progress\n" + "\n".join(lines), program, marked
    )
