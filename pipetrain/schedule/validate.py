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
from pipetrain.schedule.action import SEND_KINDS, Action, OpKind
from pipetrain.schedule.execute import describe_key, execute
from pipetrain.schedule.program import Program, ScheduleError


def validate(program: Program) -> Program:
    """Raise ``ScheduleError`` if ``program`` is malformed or cannot run; return it otherwise."""
    _check_placement(program)
    _check_counts(program)
    if program.is_lowered:
        _check_pairing(program)
        _execute_lowered(program)
    else:
        execute(program, lambda _: 1.0)
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
    """Each crossing value has one SEND and one RECV; nothing else travels. Keyed by value."""
    placement = program.placement
    seen: Counter[tuple[bool, deps.Key]] = Counter()  # (is_send, value)
    cell: dict[tuple[bool, deps.Key], tuple[int, int]] = {}
    for rank, step, action in _cells(program):
        if action.is_comm:
            tag = (action.kind in SEND_KINDS, deps.comm_key(action))
            seen[tag] += 1
            cell.setdefault(tag, (rank, step))
    needed: set[deps.Key] = set()
    for row in program.actions:
        for action in row:
            if action.is_compute:
                needed.update(k for k in deps.produces(action) if deps.crosses_ranks(k, placement))
    for (is_send, key), count in seen.items():
        name = _comm_name(is_send, key)
        if key not in needed:
            raise ScheduleError(
                f"{name} moves a value that never crosses ranks (or does not exist)",
                program,
                [cell[is_send, key]],
            )
        if count > 1:
            raise ScheduleError(f"{name} appears {count} times", program, [cell[is_send, key]])
    missing = sorted(
        _comm_name(is_send, k)
        for k in needed
        for is_send in (True, False)
        if (is_send, k) not in seen
    )
    if missing:
        names = ", ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        raise ScheduleError(f"missing communication actions: {names}", program)


def _comm_name(is_send: bool, key: deps.Key) -> str:
    send, recv = deps.transfer(key)
    return str(send if is_send else recv)


def _execute_lowered(program: Program) -> None:
    """Blocking batched P2P: post a run of comms, wait until every counterpart is posted.

    A SEND and its RECV share the value they move (``deps.comm_key``), so "counterpart posted" is
    a set lookup on (direction, value).
    """
    rows, num_stages = program.actions, program.num_stages
    have: list[set[deps.Key]] = [set() for _ in rows]
    posted: set[tuple[bool, deps.Key]] = set()
    waiting: dict[tuple[bool, deps.Key], list[int]] = {}  # counterpart -> ranks parked on it
    pos = [0] * len(rows)
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        row = rows[rank]
        while pos[rank] < len(row):
            action = row[pos[rank]]
            if action.is_compute:
                missing = [k for k in deps.requires(action, num_stages) if k not in have[rank]]
                if missing:  # nothing later can bring it: local values come from earlier actions
                    raise ScheduleError(
                        f"rank {rank} step {pos[rank]}: {action} needs "
                        f"{', '.join(describe_key(k, program.placement) for k in missing)}, "
                        "which no earlier action on this rank computed or received",
                        program,
                        [(rank, pos[rank])],
                    )
                have[rank].update(deps.produces(action))
                pos[rank] += 1
                continue
            batch = [(c.kind in SEND_KINDS, deps.comm_key(c)) for c in _batch_at(row, pos[rank])]
            for i, tag in enumerate(batch):
                if tag in posted:
                    continue
                if tag[0] and tag[1] not in have[rank]:
                    raise ScheduleError(
                        f"rank {rank} step {pos[rank] + i}: {row[pos[rank] + i]} sends a value "
                        "not yet computed here",
                        program,
                        [(rank, pos[rank] + i)],
                    )
                posted.add(tag)
                work.extend(waiting.pop(tag, ()))
            unmatched = next(((not s, k) for s, k in batch if (not s, k) not in posted), None)
            if unmatched is not None:
                waiting.setdefault(unmatched, []).append(rank)
                break
            have[rank].update(k for is_send, k in batch if not is_send)
            pos[rank] += len(batch)
    if any(p < len(r) for p, r in zip(pos, rows)):
        raise _lowered_deadlock(program, pos, posted)


def _batch_at(row: Sequence[Action], start: int) -> tuple[Action, ...]:
    end = start
    while end < len(row) and row[end].is_comm:
        end += 1
    return tuple(row[start:end])


def _lowered_deadlock(
    program: Program, pos: Sequence[int], posted: set[tuple[bool, deps.Key]]
) -> ScheduleError:
    placement = program.placement
    lines, marked = [], []
    for rank, row in enumerate(program.actions):
        if pos[rank] >= len(row):
            continue
        for i, comm in enumerate(_batch_at(row, pos[rank])):
            other = deps.peer(comm)
            if (other.kind in SEND_KINDS, deps.comm_key(other)) not in posted:
                peer_rank = placement.rank(other.stage)
                lines.append(
                    f"  rank {rank} step {pos[rank] + i}: {comm} waits for {other} on rank {peer_rank}"
                )
                marked.append((rank, pos[rank] + i))
    return ScheduleError(
        "deadlock: no rank can make progress\n" + "\n".join(lines), program, marked
    )
