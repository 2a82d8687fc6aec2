"""The run check for the runtime's own transport: posted sends, receives waited where they are read.

``validate``'s default run check plays a lowered program with *blocking batched* P2P (a rank waits
at each run of transfers until all their counterparts are posted): what torch's executor and
``batch_isend_irecv`` need, and stricter than pipetrain's runtime. The runtime (``runtime.p2p``)
posts a send and never waits for it until the step ends, posts a receive where the program puts
it, and waits for the receive only at the compute action that reads it. So a receive can sit
right before its reader (``lower.post_receives_late``) even where the blocking model would
deadlock: this module plays that transport instead.

The model, per rank, in row order:

* a SEND or RECV is posted and the rank goes on;
* transfers from one rank to another form one first-in-first-out channel (one NCCL stream per
  pair and direction; gloo's tag-0 queue per pair): the n-th send from a to b carries the n-th
  value b receives from a, and a transfer completes once both halves are posted and the one
  before it on the channel has completed. Two ends that disagree on the order would deliver one
  micro-batch's tensor into another's buffer — silently wrong where the shapes agree — so that is
  refused outright;
* a compute action waits until every value it reads was computed on the rank or has arrived;
* while shapes are being discovered (the first step) a RECV_F waits for its metadata, which
  travels on the same channel just ahead of the payload: the rank waits at the RECV_F until that
  transfer completes. The check plays this stricter first step, so the later ones follow.

A rank that cannot go on waits on its channel; if every unfinished rank waits, the error names
each one's action and what it waits for.
"""

from __future__ import annotations

from collections import deque

from pipetrain.schedule import deps
from pipetrain.schedule.action import RECV_KINDS, SEND_KINDS, Action, OpKind
from pipetrain.schedule.execute import Wait, deadlock_error, describe_key
from pipetrain.schedule.program import Program, ScheduleError

Channel = tuple[int, int]  # (sending rank, receiving rank)


def check_channel_order(program: Program) -> dict[Channel, list[deps.Key]]:
    """Each channel's values in send order; ``ScheduleError`` where the receiver's order differs."""
    rank_of = program.placement.rank
    sent: dict[Channel, list[deps.Key]] = {}
    received: dict[Channel, list[deps.Key]] = {}
    # per (kind, stage): is it a send, and which channel (the rule at micro-batch 0)
    kinds: dict[tuple[OpKind, int], tuple[bool, Channel]] = {}
    for rank, row in enumerate(program.actions):
        for action in row:
            if not action.is_comm:
                continue
            shape = (action.kind, action.stage)
            known = kinds.get(shape)
            if known is None:
                other = rank_of(deps.peer(action).stage)
                is_send = action.kind in SEND_KINDS
                known = kinds[shape] = (is_send, (rank, other) if is_send else (other, rank))
            is_send, channel = known
            (sent if is_send else received).setdefault(channel, []).append(deps.comm_key(action))
    for channel, values in received.items():
        if values != sent.get(channel):
            _order_error(program, channel, values, sent.get(channel, []))
    return sent


def _order_error(
    program: Program, channel: Channel, received: list[deps.Key], sent: list[deps.Key]
) -> None:
    a, b = channel
    n, got, expected = next(
        (n, got, expected)
        for n, (got, expected) in enumerate(zip(received, sent))
        if got != expected
    )
    step = next(
        i
        for i, action in enumerate(program.actions[b])
        if action.is_comm and action.kind in RECV_KINDS and deps.comm_key(action) == got
    )
    placement = program.placement
    raise ScheduleError(
        f"rank {b} receives {describe_key(got, placement)} as transfer {n} from rank {a}, but "
        f"rank {a} sends {describe_key(expected, placement)} as its transfer {n} to rank {b}: "
        "transfers between two ranks must be in the same order on both ends (they match by "
        "position, not by name)",
        program,
        [(b, step)],
    )


def run_posted(program: Program) -> None:
    """Play a paired, lowered program with the runtime's transport; ``ScheduleError`` on deadlock.

    Pairing and each row's own order (a SEND after its value is computed, a compute after its
    inputs' RECVs) are ``transfer_checks``'s; this checks the order on every channel and then
    that every rank reaches its row's end.
    """
    placement = program.placement
    per_chain = placement.stages_per_chain
    rows = program.actions
    sent = check_channel_order(program)
    # position of each value on its channel, and the channel
    index: dict[deps.Key, tuple[Channel, int]] = {
        key: (channel, n) for channel, values in sent.items() for n, key in enumerate(values)
    }
    sends_posted: dict[Channel, int] = dict.fromkeys(sent, 0)
    recvs_posted: dict[Channel, int] = dict.fromkeys(sent, 0)
    completed: dict[Channel, int] = dict.fromkeys(sent, 0)
    local: list[set[deps.Key]] = [set() for _ in rows]
    pos = [0] * len(rows)
    parked: dict[Channel, list[int]] = {}
    blocked_on: dict[int, tuple[int, Action, deps.Key]] = {}
    work = deque(range(len(rows)))

    def arrived(key: deps.Key) -> bool:
        channel, n = index[key]
        return completed[channel] > n

    def advance(channel: Channel) -> None:
        done = min(sends_posted[channel], recvs_posted[channel])
        if done > completed[channel]:
            completed[channel] = done
            work.extend(parked.pop(channel, ()))

    while work:
        rank = work.popleft()
        row, here = rows[rank], local[rank]
        blocked_on.pop(rank, None)
        while pos[rank] < len(row):
            action = row[pos[rank]]
            if action.is_comm:
                key = deps.comm_key(action)
                channel, n = index[key]
                if action.kind in SEND_KINDS:
                    sends_posted[channel] += 1
                    advance(channel)
                else:
                    if recvs_posted[channel] == n:  # posted once, even when waited for again
                        recvs_posted[channel] += 1
                        advance(channel)
                    if action.kind is OpKind.RECV_F and not arrived(key):
                        blocked_on[rank] = (pos[rank], action, key)
                        parked.setdefault(channel, []).append(rank)
                        break
                    if action.kind in RECV_KINDS and arrived(key):
                        here.add(key)
                pos[rank] += 1
                continue
            missing = None
            for key in deps.requires(action, per_chain):
                if key in here:
                    continue
                if key in index and index[key][0][1] == rank and arrived(key):
                    here.add(key)
                    continue
                missing = key
                break
            if missing is not None:
                if missing not in index:
                    raise ScheduleError(
                        f"rank {rank} step {pos[rank]}: {action} needs "
                        f"{describe_key(missing, placement)}, which nothing before it brings",
                        program,
                        [(rank, pos[rank])],
                    )
                blocked_on[rank] = (pos[rank], action, missing)
                parked.setdefault(index[missing][0], []).append(rank)
                break
            here.update(deps.produces(action))
            pos[rank] += 1
    if any(p < len(row) for p, row in zip(pos, rows)):
        waits = [
            Wait(rank, step, action, describe_key(key, placement))
            for rank, (step, action, key) in sorted(blocked_on.items())
        ]
        raise deadlock_error(program, waits)
