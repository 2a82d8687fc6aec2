"""Validation's checks of a lowered program's transfers (``validate`` steps 3 and 4).

Every cross-rank value travels exactly once (``check_pairing``), and the program runs to the end
with *blocking batched* P2P (``execute_lowered``): a run of consecutive SEND/RECV actions on a
rank is posted at once, and the rank waits until each of them has its counterpart posted — what
``batch_isend_irecv`` followed by ``wait`` does. Both read each row's scan (``transfer_scan``):
what a rank checks on its own is found there, so what is played here is only what ranks wait
for — each batch's counterparts — batch by batch; a rank that reaches its row's first failure
raises it there: the same failure, in the same order, as playing every action.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from itertools import compress, repeat

from pipetrain.schedule import deps
from pipetrain.schedule.action import SEND_KINDS, Action
from pipetrain.schedule.execute import Wait, deadlock_error
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.transfer_scan import RowScan


def check_pairing(program: Program, scans: list[RowScan] | None, chains: tuple[int, ...]) -> None:
    """Each crossing value has one SEND and one RECV; nothing else travels.

    Fast path: the sent values and the received values must each equal the set of crossing
    values, without repeats — as posts, every post must be one of the crossing values' SEND
    and RECV posts, and there must be as many as those. Counts have been checked, so every
    (stage, micro-batch) has its F and its B or I: the crossing values are every micro-batch of
    each crossing (token, stage) in the rule's transfer tables. Otherwise ``_pairing_error`` names
    the culprit.
    """
    if scans is not None:
        rule = deps.compile_rule(program.placement)
        placement, m = program.placement, program.num_microbatches
        crossing = {  # each crossing value's SEND and RECV post at micro-batch 0, by chain
            (
                rule.posts[t.send.kind][t.send.stage].id,
                rule.posts[t.recv.kind][t.recv.stage].id,
                placement.chain(t.send.stage),
            )
            for transfers_of_stage in rule.transfers.values()
            for transfers in transfers_of_stage.values()
            for t in transfers
        }
        # whole masks and lengths are compared (C loops), never one post at a time: a byte per
        # post id (placement has been checked, so every id is below ``post_stride · m``); with
        # one chain a crossing value's posts are a slice
        stride = rule.post_stride
        needed, posted = bytearray(stride * m), bytearray(stride * m)
        ones = b"\x01" * m
        for send, recv, c in crossing:
            for post in (send, recv):
                if placement.num_chains == 1:
                    needed[post::stride] = ones
                else:
                    for j in range(m):
                        needed[post + j * stride] |= chains[j] == c
        count = 0
        for scan in scans:
            deque(map(posted.__setitem__, scan.posts, repeat(1)), maxlen=0)
            count += len(scan.posts)
        # equal masks and as many posts as ids: each needed post made once, nothing else
        if posted == needed and count == needed.count(1):
            return
    _pairing_error(program)


def _pairing_error(program: Program) -> None:
    """Raise naming the first pairing problem. Keyed by value."""
    placement = program.placement
    seen: Counter[tuple[bool, deps.Key]] = Counter()  # (is_send, value)
    cell: dict[tuple[bool, deps.Key], tuple[int, int]] = {}
    for rank, step, action in program.cells():
        if action.is_comm:
            half = (action.kind in SEND_KINDS, deps.comm_key(action))
            seen[half] += 1
            cell.setdefault(half, (rank, step))
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


def execute_lowered(program: Program, scans: list[RowScan]) -> None:
    """Blocking batched P2P: post a run of comms, wait until every counterpart is posted.

    Pairing has been checked, so each post is made once, by one rank, and every id is below
    ``post_stride`` times the micro-batch count (placement has been checked): what is posted is
    a byte per id. A post's counterpart is its id with the lowest bit flipped
    (``transfer_scan``). A rank that arrives at its row's failing batch
    (``RowScan.failing_batch``) raises the row's first own failure.
    """
    rows = program.actions
    posted = bytearray(deps.compile_rule(program.placement).post_stride * program.num_microbatches)
    waiting: dict[int, list[int]] = {}  # counterpart id -> ranks parked on it
    next_batch = [0] * len(rows)
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        scan = scans[rank]
        batched, offsets, failing_batch = scan.batched, scan.offsets, scan.failing_batch
        b, end = next_batch[rank], len(offsets) - 1
        while b < end:
            if b == failing_batch:
                assert scan.failure is not None
                raise scan.failure()
            # Post everything, then wait on the first post whose counterpart is missing. One loop
            # does both: a batch never holds both halves of a transfer (they live on two ranks).
            unmatched = -1
            for post in batched[offsets[b] : offsets[b + 1]]:
                if not posted[post]:
                    posted[post] = 1
                    if post in waiting:
                        work.extend(waiting.pop(post))
                if unmatched < 0 and not posted[post ^ 1]:
                    unmatched = post ^ 1
            if unmatched >= 0:
                waiting.setdefault(unmatched, []).append(rank)
                break
            b += 1  # every counterpart is posted: the batch completes
        next_batch[rank] = b
    pos = [
        scan.first_steps[b] if b < len(scan.offsets) - 1 else len(row)
        for scan, b, row in zip(scans, next_batch, rows)
    ]
    if any(p < len(r) for p, r in zip(pos, rows)):
        ids = set(compress(range(len(posted)), posted))
        raise deadlock_error(program, _stuck_posts(program, pos, ids))


def _batch_at(row: Sequence[Action], start: int) -> tuple[Action, ...]:
    end = start
    while end < len(row) and row[end].is_comm:
        end += 1
    return tuple(row[start:end])


def _stuck_posts(program: Program, pos: Sequence[int], posted: set[int]) -> list[Wait]:
    """Each stuck rank's SEND/RECV actions whose counterpart was never posted."""
    placement = program.placement
    rule = deps.compile_rule(placement)
    waits = []
    for rank, row in enumerate(program.actions):
        if pos[rank] >= len(row):
            continue
        for i, comm in enumerate(_batch_at(row, pos[rank])):
            other = deps.peer(comm)
            if rule.post_id(other) not in posted:
                where = f"{other} on rank {placement.rank(other.stage)}"
                waits.append(Wait(rank, pos[rank] + i, comm, where))
    return waits
