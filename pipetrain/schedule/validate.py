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
from pipetrain.schedule.action import COMM_KINDS, SEND_KINDS, Action, OpKind
from pipetrain.schedule.execute import describe_key, execute
from pipetrain.schedule.program import Program, ScheduleError, microbatch_chains


def validate(program: Program) -> Program:
    """Raise ``ScheduleError`` if ``program`` is malformed or cannot run; return it otherwise."""
    _check_placement(program)
    _check_counts(program)
    if program.is_lowered:
        tags = _comm_tags(program)
        _check_pairing(program, tags)
        _execute_lowered(program, tags)
    else:
        execute(program, lambda _: 1.0)
    return program


def _cells(program: Program):
    for rank, row in enumerate(program.actions):
        for step, action in enumerate(row):
            yield rank, step, action


def _check_placement(program: Program) -> None:
    # A quick scan finds the first bad cell; _placement_error then says exactly what is wrong.
    rank_of = dict(enumerate(program.placement.rank_of_stage))  # .get: no wrap-around at -1
    m = program.num_microbatches
    for rank, row in enumerate(program.actions):
        for step, action in enumerate(row):
            for part in action.compute_parts:  # a comm action is its own single part
                if rank_of.get(part.stage) != rank or not 0 <= part.microbatch < m:
                    raise _placement_error(program, rank, step, action)


def _placement_error(program: Program, rank: int, step: int, action: Action) -> ScheduleError:
    placement, m = program.placement, program.num_microbatches
    for part in action.compute_parts:
        if not 0 <= part.stage < placement.num_stages:
            return ScheduleError(
                f"rank {rank} step {step}: {action} names stage {part.stage}; "
                f"legal stages are 0..{placement.num_stages - 1}",
                program,
                [(rank, step)],
            )
        if not 0 <= part.microbatch < m:
            return ScheduleError(
                f"rank {rank} step {step}: {action} names micro-batch {part.microbatch}; "
                f"legal micro-batches are 0..{m - 1}",
                program,
                [(rank, step)],
            )
        if placement.rank(part.stage) != rank:
            return ScheduleError(
                f"rank {rank} step {step}: {action} runs stage {part.stage}, which lives on "
                f"rank {placement.rank(part.stage)}",
                program,
                [(rank, step)],
            )
    raise RuntimeError(f"internal: rank {rank} step {step}: {action} passed every placement check")


def _check_counts(program: Program) -> None:
    # Tally per kind in flat lists (stage and micro-batch are in range: placement came first);
    # only a failure pays for _counts_error's per-cell bookkeeping.
    m = program.num_microbatches
    tally = {k: [0] * (program.num_stages * m) for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W)}
    for row in program.actions:
        for action in row:
            if action.is_compute:
                for p in action.compute_parts:
                    tally[p.kind][p.stage * m + p.microbatch] += 1
    expected = _expected_cells(program)
    ok = all(
        _complete(f, b, i, w) if wanted else f == b == i == w == 0
        for wanted, f, b, i, w in zip(
            expected, tally[OpKind.F], tally[OpKind.B], tally[OpKind.I], tally[OpKind.W]
        )
    )
    if not ok:
        _counts_error(program, expected)


def _complete(f: int, b: int, i: int, w: int) -> bool:
    """One (stage, micro-batch) runs one F and either one B or one I and one W."""
    return f == 1 and ((b == 1 and i == w == 0) or (b == 0 and i == w == 1))


def _expected_cells(program: Program) -> list[bool]:
    """For each (stage, micro-batch), flattened as stage·m + micro-batch: must it run? With one
    chain every cell must; with several, a micro-batch runs on its chain's stages only."""
    m, placement = program.num_microbatches, program.placement
    if placement.num_chains == 1:
        return [True] * (program.num_stages * m)
    chains = microbatch_chains(program)
    return [
        placement.chain(stage) == chains[j] for stage in range(program.num_stages) for j in range(m)
    ]


def _counts_error(program: Program, expected: list[bool]) -> None:
    where: dict[tuple[OpKind, int, int], list[tuple[int, int]]] = {}
    for rank, step, action in _cells(program):
        if action.is_compute:
            for p in action.compute_parts:
                where.setdefault((p.kind, p.stage, p.microbatch), []).append((rank, step))
    m = program.num_microbatches
    for stage in range(program.num_stages):
        for mb in range(m):
            n = {
                k: len(where.get((k, stage, mb), ()))
                for k in (OpKind.F, OpKind.B, OpKind.I, OpKind.W)
            }
            cells = [c for k in n for c in where.get((k, stage, mb), ())]
            found = ", ".join(f"{v} {k.value}" for k, v in n.items())
            if not expected[stage * m + mb]:
                if cells:
                    raise ScheduleError(
                        f"micro-batch {mb} flows through another chain, but stage {stage} runs "
                        f"it ({found})",
                        program,
                        cells,
                    )
                continue
            if not _complete(n[OpKind.F], n[OpKind.B], n[OpKind.I], n[OpKind.W]):
                raise ScheduleError(
                    f"stage {stage} micro-batch {mb} needs exactly one F and either one B or one I "
                    f"and one W; found {found}",
                    program,
                    cells,
                )


# Pairing and execution of a lowered program work on *tags*: a SEND or RECV of value v (a
# ``deps.compile_rule`` integer) is ``2·v + 1`` for the SEND and ``2·v`` for the RECV, so the
# counterpart of a tag is ``tag ^ 1``. Compute actions get the tag -1.
_COMPUTE = -1


def _comm_tags(program: Program) -> list[list[int]] | None:
    """Each cell's tag, or None if a SEND/RECV moves a value that cannot exist (e.g. RECV_F on
    stage 0); placement has been checked, so every stage is in range."""
    rule = deps.compile_rule(program.placement)
    moves, stride = rule.moves, rule.stride
    if not all(key in moves for row in program.actions for key in _comm_cells(row)):
        return None
    return [
        [
            2 * (moves[a.kind, a.stage] + a.microbatch * stride) + (a.kind in SEND_KINDS)
            if a.kind in COMM_KINDS
            else _COMPUTE
            for a in row
        ]
        for row in program.actions
    ]


def _comm_cells(row: Sequence[Action]) -> list[tuple[OpKind, int]]:
    return [(a.kind, a.stage) for a in row if a.kind in COMM_KINDS]


def _check_pairing(program: Program, tags: list[list[int]] | None) -> None:
    """Each crossing value has one SEND and one RECV; nothing else travels.

    Fast path: the sent values and the received values must each equal the set of crossing
    values, without repeats. Counts have been checked, so every (stage, micro-batch) has its F and
    its B or I: the crossing values are every micro-batch of each crossing (token, stage) in the
    rule's transfer tables. Otherwise ``_pairing_error`` names the culprit.
    """
    if tags is not None:
        rule = deps.compile_rule(program.placement)
        placement, m = program.placement, program.num_microbatches
        bases = {
            (t.value, placement.chain(t.send.stage))
            for transfers in rule.transfers.values()
            for t in transfers
        }
        chains = microbatch_chains(program)
        needed = {b + j * rule.stride for b, c in bases for j in range(m) if chains[j] == c}
        sent = [tag >> 1 for row in tags for tag in row if tag >= 0 and tag & 1]
        received = [tag >> 1 for row in tags for tag in row if tag >= 0 and not tag & 1]
        if all(len(v) == len(needed) and set(v) == needed for v in (sent, received)):
            return
    _pairing_error(program)


def _pairing_error(program: Program) -> None:
    """Raise naming the first pairing problem. Keyed by value."""
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


def _execute_lowered(program: Program, tags: list[list[int]]) -> None:
    """Blocking batched P2P: post a run of comms, wait until every counterpart is posted.

    A SEND and its RECV share the value they move (``deps.comm_key``), so "counterpart posted" is
    a set lookup on tags (see ``_comm_tags``).
    """
    rule = deps.compile_rule(program.placement)
    needs_of, makes_of, stride = rule.needs, rule.makes, rule.stride
    rows = program.actions
    have: list[set[int]] = [set() for _ in rows]  # values computed or received on each rank
    posted: set[int] = set()
    waiting: dict[int, list[int]] = {}  # counterpart tag -> ranks parked on it
    pos = [0] * len(rows)
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        row, row_tags, mine, step = rows[rank], tags[rank], have[rank], pos[rank]
        while step < len(row):
            if row_tags[step] == _COMPUTE:
                parts = row[step].compute_parts
                for part in parts:
                    shift = part.microbatch * stride
                    for need in needs_of[part.kind, part.stage]:
                        if need[0] + shift not in mine:  # need[0]: the value at micro-batch 0
                            # nothing later can bring it: local values come from earlier actions
                            raise _missing_input(program, rank, step, mine)
                for part in parts:
                    shift = part.microbatch * stride
                    for base in makes_of[part.kind, part.stage]:
                        mine.add(base + shift)
                step += 1
                continue
            # a run of SEND/RECV actions is one batch: post them all, then wait for their peers
            end = step + 1
            while end < len(row) and row_tags[end] != _COMPUTE:
                end += 1
            batch = row_tags[step:end]
            for i, tag in enumerate(batch):
                if tag in posted:
                    continue
                if tag & 1 and tag >> 1 not in mine:
                    raise ScheduleError(
                        f"rank {rank} step {step + i}: {row[step + i]} sends a value "
                        "not yet computed here",
                        program,
                        [(rank, step + i)],
                    )
                posted.add(tag)
                if tag in waiting:
                    work.extend(waiting.pop(tag))
            unmatched = [tag ^ 1 for tag in batch if tag ^ 1 not in posted]
            if unmatched:
                waiting.setdefault(unmatched[0], []).append(rank)
                break
            for tag in batch:
                if not tag & 1:  # a receive: the value is here now
                    mine.add(tag >> 1)
            step = end
        pos[rank] = step
    if any(p < len(r) for p, r in zip(pos, rows)):
        raise _lowered_deadlock(program, pos, posted)


def _missing_input(program: Program, rank: int, step: int, have: set[int]) -> ScheduleError:
    rule = deps.compile_rule(program.placement)
    action = program.actions[rank][step]
    missing = [
        k
        for k in deps.requires(action, program.placement.stages_per_chain)
        if rule.value(k) not in have
    ]
    return ScheduleError(
        f"rank {rank} step {step}: {action} needs "
        f"{', '.join(describe_key(k, program.placement) for k in missing)}, "
        "which no earlier action on this rank computed or received",
        program,
        [(rank, step)],
    )


def _batch_at(row: Sequence[Action], start: int) -> tuple[Action, ...]:
    end = start
    while end < len(row) and row[end].is_comm:
        end += 1
    return tuple(row[start:end])


def _lowered_deadlock(program: Program, pos: Sequence[int], posted: set[int]) -> ScheduleError:
    placement = program.placement
    rule = deps.compile_rule(placement)
    lines, marked = [], []
    for rank, row in enumerate(program.actions):
        if pos[rank] >= len(row):
            continue
        for i, comm in enumerate(_batch_at(row, pos[rank])):
            other = deps.peer(comm)
            tag = 2 * rule.value(deps.comm_key(other)) + (other.kind in SEND_KINDS)
            if tag not in posted:
                peer_rank = placement.rank(other.stage)
                lines.append(
                    f"  rank {rank} step {pos[rank] + i}: {comm} waits for {other} on rank {peer_rank}"
                )
                marked.append((rank, pos[rank] + i))
    return ScheduleError(
        "deadlock: no rank can make progress\n" + "\n".join(lines), program, marked
    )
