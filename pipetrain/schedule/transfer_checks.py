"""Validation's checks of a lowered program's transfers (``validate`` steps 3 and 4).

Every cross-rank value travels exactly once (``check_pairing``), and the program runs to the end
with *blocking batched* P2P (``execute_lowered``): a run of consecutive SEND/RECV actions on a
rank is posted at once, and the rank waits until each of them has its counterpart posted — what
``batch_isend_irecv`` followed by ``wait`` does. ``scan_lowered`` reads each row once for both.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from pipetrain.schedule import deps
from pipetrain.schedule.action import SEND_KINDS, Action, OpKind
from pipetrain.schedule.execute import describe_key
from pipetrain.schedule.program import Program, ScheduleError

# Pairing and execution of a lowered program work on *tags*: a SEND or RECV of value v (a
# ``deps.compile_rule`` integer) is ``2·v + 1`` for the SEND and ``2·v`` for the RECV, so the
# counterpart of a tag is ``tag ^ 1``.
#
# Execution splits in two. What a rank checks on its own — a compute action's inputs were computed
# or received earlier on the rank, a SEND's value was computed before its batch is posted — depends
# on that row alone, so one pass per row (``_scan_row``) finds the first such failure and the
# row's batches. What ranks wait for — each batch's counterparts — is then played batch by batch,
# and a rank that reaches its row's first failure raises it there: the same failure, in the same
# order, as playing every action.


@dataclass(frozen=True, slots=True)
class _RowScan:
    """One rank's row of a lowered program, read on its own.

    Integers, in lists and tuples of integers only: a row holds ~10^4 batches, and the garbage
    collector stops tracking a tuple of integers, while every tracked object that lives on makes
    it walk the program's ~10^5 actions again sooner.
    """

    #: tags of the row's SEND/RECV actions, in row order
    tags: list[int]
    #: each batch's tags, up to the row's first failure; the last batch is an empty one at the
    #: row's end, where a rank arrives once its last real batch completes
    batches: list[tuple[int, ...]]
    #: the step at which each batch starts (the last: ``len(row)``)
    first_steps: list[int]
    #: the batch at whose arrival the row's first own failure is raised (-1: none), and the error
    failing_batch: int
    failure: Callable[[], ScheduleError] | None


def scan_lowered(program: Program) -> list[_RowScan] | None:
    """Each row's scan, or None if a SEND/RECV moves a value that cannot exist (e.g. RECV_F on
    stage 0); placement has been checked, so every stage is in range."""
    rule = deps.compile_rule(program.placement)
    # The rule's tables as the scan reads them, at micro-batch 0: a SEND/RECV's tag, and a
    # compute action's (values needed, values made).
    tag_of = {
        kind: {stage: 2 * value + (kind in SEND_KINDS) for stage, value in values.items()}
        for kind, values in rule.moves.items()
    }
    plan_of = {
        kind: {
            stage: (tuple(need[0] for need in needs), rule.awaited[kind][stage])
            for stage, needs in needs_of_stage.items()
        }
        for kind, needs_of_stage in rule.needs.items()
    }
    scans = []
    for rank, row in enumerate(program.actions):
        scan = _scan_row(program, rank, row, tag_of, plan_of, rule.stride)
        if scan is None:
            return None
        scans.append(scan)
    return scans


def _scan_row(
    program: Program,
    rank: int,
    row: Sequence[Action],
    tag_of: dict[OpKind, dict[int, int]],
    plan_of: dict[OpKind, dict[int, tuple[tuple[int, ...], tuple[int, ...]]]],
    stride: int,
) -> _RowScan | None:
    """Tags, batches and the first failure of one row (tables at micro-batch 0, see the caller)."""
    tag_stride = 2 * stride
    tags: list[int] = []
    batches: list[tuple[int, ...]] = []
    first_steps: list[int] = []
    batch: list[int] = []  # tags of the open batch (the run of SEND/RECV actions just read)
    landing: list[int] = []  # values the open batch receives: here once it completes
    mine: set[int] = set()  # values computed or received on this rank so far
    failing_batch, failure = -1, None
    for step, action in enumerate(row):
        if action.parts:
            plan = _pair_plan(action, plan_of, stride)
            shift = 0  # the pair's plan holds its parts' own values
        else:
            tag = tag_of[action.kind].get(action.stage)
            if tag is not None:  # a SEND or RECV
                tag += action.microbatch * tag_stride
                tags.append(tag)
                if failure is not None:
                    continue  # past the row's first failure only the tags count (pairing)
                if not batch:
                    first_steps.append(step)
                batch.append(tag)
                if not tag & 1:
                    landing.append(tag >> 1)
                elif tag >> 1 not in mine:
                    failing_batch = len(first_steps) - 1
                    failure = partial(_unsent_error, program, rank, step)
                continue
            plan = plan_of[action.kind].get(action.stage)
            if plan is None:
                return None  # a SEND/RECV of a value that cannot exist
            shift = action.microbatch * stride
        if failure is not None:
            continue
        if batch:  # the batch before this action completes before it
            batches.append(tuple(batch))
            batch.clear()
            mine.update(landing)
            landing.clear()
        needs, awaited = plan
        for value in needs:
            if value + shift not in mine:
                # nothing later can bring it: local values come from earlier actions
                failing_batch = len(first_steps)  # the rank gets here after the batch before
                failure = partial(_missing_input, program, rank, step, mine)
                break
        else:
            for value in awaited:
                mine.add(value + shift)
    if batch:
        batches.append(tuple(batch))
    first_steps.append(len(row))  # the empty last batch
    batches.append(())
    return _RowScan(tags, batches, first_steps, failing_batch, failure)


def _pair_plan(
    pair: Action,
    plan_of: dict[OpKind, dict[int, tuple[tuple[int, ...], tuple[int, ...]]]],
    stride: int,
) -> tuple[list[int], list[int]]:
    """An overlapped pair's (values needed, values made), each part's shifted to its micro-batch:
    every part's inputs must be here before the pair starts."""
    needs: list[int] = []
    awaited: list[int] = []
    for part in pair.parts:
        part_needs, part_awaited = plan_of[part.kind][part.stage]
        shift = part.microbatch * stride
        for value in part_needs:
            needs.append(value + shift)
        for value in part_awaited:
            awaited.append(value + shift)
    return needs, awaited


def check_pairing(program: Program, scans: list[_RowScan] | None, chains: tuple[int, ...]) -> None:
    """Each crossing value has one SEND and one RECV; nothing else travels.

    Fast path: the sent values and the received values must each equal the set of crossing
    values, without repeats — as tags, every tag moved must be one of the crossing values' SEND
    and RECV tags, and there must be as many as those. Counts have been checked, so every
    (stage, micro-batch) has its F and its B or I: the crossing values are every micro-batch of
    each crossing (token, stage) in the rule's transfer tables. Otherwise ``_pairing_error`` names
    the culprit.
    """
    if scans is not None:
        rule = deps.compile_rule(program.placement)
        placement, m = program.placement, program.num_microbatches
        bases = {
            (t.value, placement.chain(t.send.stage))
            for transfers_of_stage in rule.transfers.values()
            for transfers in transfers_of_stage.values()
            for t in transfers
        }
        # whole sets and lengths are compared (C loops), never one tag at a time
        offsets = {
            c: [2 * j * rule.stride for j in range(m) if chains[j] == c]
            for c in range(placement.num_chains)
        }
        needed: set[int] = set()
        for base, c in bases:
            needed.update([2 * base + offset for offset in offsets[c]])
            needed.update([2 * base + 1 + offset for offset in offsets[c]])
        posted: set[int] = set()
        for scan in scans:
            posted.update(scan.tags)
        if sum(len(scan.tags) for scan in scans) == len(needed) and posted == needed:
            return
    _pairing_error(program)


def _pairing_error(program: Program) -> None:
    """Raise naming the first pairing problem. Keyed by value."""
    placement = program.placement
    seen: Counter[tuple[bool, deps.Key]] = Counter()  # (is_send, value)
    cell: dict[tuple[bool, deps.Key], tuple[int, int]] = {}
    for rank, step, action in program.cells():
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


def execute_lowered(program: Program, scans: list[_RowScan]) -> None:
    """Blocking batched P2P: post a run of comms, wait until every counterpart is posted.

    Pairing has been checked, so each tag is posted once, by one rank. A rank that arrives at its
    row's failing batch (``_RowScan.failing_batch``) raises the row's first own failure.
    """
    rows = program.actions
    posted: set[int] = set()
    waiting: dict[int, list[int]] = {}  # counterpart tag -> ranks parked on it
    next_batch = [0] * len(rows)
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        scan = scans[rank]
        batches, b, failing_batch = scan.batches, next_batch[rank], scan.failing_batch
        while b < len(batches):
            if b == failing_batch:
                raise scan.failure()
            # Post every tag, then wait on the first whose counterpart is missing. One loop does
            # both: a batch never holds a tag and its counterpart (they live on different ranks).
            unmatched = None
            for tag in batches[b]:
                if tag not in posted:
                    posted.add(tag)
                    if tag in waiting:
                        work.extend(waiting.pop(tag))
                if unmatched is None and tag ^ 1 not in posted:
                    unmatched = tag ^ 1
            if unmatched is not None:
                waiting.setdefault(unmatched, []).append(rank)
                break
            b += 1  # every counterpart is posted: the batch completes
        next_batch[rank] = b
    pos = [
        scan.first_steps[b] if b < len(scan.batches) else len(row)
        for scan, b, row in zip(scans, next_batch, rows)
    ]
    if any(p < len(r) for p, r in zip(pos, rows)):
        raise _lowered_deadlock(program, pos, posted)


def _unsent_error(program: Program, rank: int, step: int) -> ScheduleError:
    return ScheduleError(
        f"rank {rank} step {step}: {program.actions[rank][step]} sends a value "
        "not yet computed here",
        program,
        [(rank, step)],
    )


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
