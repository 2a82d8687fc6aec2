"""The run check for the runtime's own transport: posted sends, receives waited where they are read.

``validate``'s default run check plays a lowered program with *blocking batched* P2P (a rank waits
at each run of transfers until all their counterparts are posted): what torch's executor and
``batch_isend_irecv`` need, and stricter than pipetrain's runtime. The runtime (``runtime.comm.p2p``)
posts a send and never waits for it until the step ends, posts a receive where the program puts
it, and waits for the receive only at the compute action that reads it. So a receive can sit
right before its reader (``lower.post_receives_late``) even where the blocking model would
deadlock: this module plays that transport instead.

The model, per rank, in row order:

* a SEND or RECV is posted and the rank goes on;
* transfers from one rank to another match by position: the n-th send from a to b carries the
  n-th value b receives from a. Two ends that disagree on the order would deliver one
  micro-batch's tensor into another's buffer — silently wrong where the shapes agree — so that
  is refused outright (``check_channel_order``);
* on each rank, the transfers whose data flows towards higher ranks (sends to higher ranks,
  receives from lower ones) run one after the other in posting order, and so do those flowing
  down: the runtime's two process groups (``runtime.comm.p2p``). A transfer runs once its send and
  its receive are each first in their stream. Today's NCCL runs each *pair* of ranks of a group
  on a stream of its own, so this is stricter than needed; it also holds where a backend runs a
  whole group on one communicator (as torch does for batched P2P once the process group is
  initialised eagerly), so a program it accepts cannot hang there either. Gloo queues per pair;
  it is covered the same way;
* a compute action waits until every value it reads was computed on the rank or has arrived;
* while shapes are being discovered (the first step) a RECV_F waits for its metadata, which
  travels in the same stream just ahead of the payload: the rank waits at the RECV_F until that
  transfer has run. The check plays this stricter first step, so the later ones follow.

A rank that cannot go on waits on a transfer; if every unfinished rank waits, the error names
each one's action and what it waits for.
"""

from __future__ import annotations

from collections import deque
from operator import attrgetter

from pipetrain.schedule import deps
from pipetrain.schedule.action import RECV_KINDS, Action, OpKind
from pipetrain.schedule.execute import Wait, deadlock_error, describe_key
from pipetrain.schedule.program import Program, ScheduleError

Channel = tuple[int, int]  # (sending rank, receiving rank)
_kind_stage = attrgetter("kind", "stage")
_microbatch = attrgetter("microbatch")


def check_channel_order(program: Program) -> dict[Channel, list[deps.Key]]:
    """Each channel's values in send order; ``ScheduleError`` where the receiver's order differs."""
    key = deps.compile_rule(program.placement).key
    return {
        channel: [key(value) for value in values]
        for channel, values in check_channels(program).items()
    }


def check_channels(program: Program) -> dict[Channel, list[int]]:
    """``check_channel_order`` with the values as the rule's integers (``deps.CompiledRule``):
    what ``validate`` needs, without a key per transfer. Pairing has been checked, so every
    SEND/RECV moves a value that travels."""
    stride = deps.compile_rule(program.placement).stride
    lists = ChannelLists(program)
    for row in program.actions:
        for kind_stage, microbatch in zip(map(_kind_stage, row), map(_microbatch, row)):
            entry = lists.of_post.get(kind_stage)
            if entry is not None:
                entry[0].append(entry[1] + microbatch * stride)
    return lists.check()


class ChannelLists:
    """Each channel's values as sent and as received, filled by a reader of the rows
    (``check_channels``, or validation's scan of each row, ``transfer_scan``) and then
    compared (``check``)."""

    def __init__(self, program: Program) -> None:
        self.program = program
        rule = deps.compile_rule(program.placement)
        rank_of = program.placement.rank_of_stage
        self.sent: dict[Channel, list[int]] = {}
        self.received: dict[Channel, list[int]] = {}
        #: per (kind, stage) of a SEND/RECV: the list its values go to, and its value at
        #: micro-batch 0 (its rank is its stage's: placement has been checked)
        self.of_post: dict[tuple[OpKind, int], tuple[list[int], int]] = {}
        for kind, of_stage in rule.posts.items():
            for stage, post in of_stage.items():
                token, value_stage, _ = rule.key(post.value)
                per_chain = program.placement.stages_per_chain
                other = deps.consumer_stage((token, value_stage, 0), per_chain)
                if other is None or other >= len(rank_of):
                    continue  # a value that never travels: pairing refuses its SEND/RECV
                channel = (rank_of[value_stage], rank_of[other])
                to = (self.sent if post.is_send else self.received).setdefault(channel, [])
                self.of_post[kind, stage] = (to, post.value)

    def check(self) -> dict[Channel, list[int]]:
        """Each channel's values in send order; ``ScheduleError`` where the receiver's differ."""
        for channel, values in self.received.items():
            if values and values != self.sent.get(channel):
                key = deps.compile_rule(self.program.placement).key
                _order_error(
                    self.program,
                    channel,
                    [key(v) for v in values],
                    [key(v) for v in self.sent.get(channel, [])],
                )
        return {channel: values for channel, values in self.sent.items() if values}


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
    inputs' RECVs) are ``transfer_checks``'s; this checks the order between every two ranks and
    then that every rank reaches its row's end with each direction's transfers run in order.
    """
    _PostedRun(program, check_channel_order(program)).run()


class _PostedRun:
    """The state of one play: each rank's position and values, the transfer streams, and who
    waits for what."""

    def __init__(self, program: Program, sent: dict[Channel, list[deps.Key]]) -> None:
        self.program = program
        self.per_chain = program.placement.stages_per_chain
        self.rows = program.actions
        self.ends: dict[deps.Key, Channel] = {
            key: channel for channel, values in sent.items() for key in values
        }
        # one first-in-first-out stream per rank and direction; each op is its transfer's key
        self.streams: dict[tuple[int, bool], deque[deps.Key]] = {}
        self.halves_first: dict[deps.Key, int] = {}  # halves of a transfer first in line
        self.arrived: set[deps.Key] = set()
        self.local: list[set[deps.Key]] = [set() for _ in self.rows]
        self.pos = [0] * len(self.rows)
        self.parked: dict[deps.Key, list[int]] = {}
        self.blocked_on: dict[int, tuple[int, Action, deps.Key]] = {}
        self.work = deque(range(len(self.rows)))
        # a rank waiting at a RECV_F it has already posted: its step
        self.posted_at: dict[int, int] = {}

    def run(self) -> None:
        while self.work:
            self.advance(self.work.popleft())
        if any(p < len(row) for p, row in zip(self.pos, self.rows)):
            waits = [
                Wait(rank, step, action, describe_key(key, self.program.placement))
                for rank, (step, action, key) in sorted(self.blocked_on.items())
            ]
            raise deadlock_error(self.program, waits)

    def advance(self, rank: int) -> None:
        """Run ``rank``'s row from where it stopped until it waits or ends."""
        row = self.rows[rank]
        self.blocked_on.pop(rank, None)
        while self.pos[rank] < len(row):
            action = row[self.pos[rank]]
            if action.is_comm:
                waiting = self.transfer(rank, action)
            else:
                waiting = self.compute(rank, action)
            if waiting is not None:
                self.blocked_on[rank] = (self.pos[rank], action, waiting)
                self.parked.setdefault(waiting, []).append(rank)
                return
            self.pos[rank] += 1

    def transfer(self, rank: int, action: Action) -> deps.Key | None:
        """Post a SEND or RECV (once); the key a RECV_F waits for while shapes are discovered."""
        key = deps.comm_key(action)
        if self.posted_at.get(rank) != self.pos[rank]:
            self.post(rank, key)
        if action.kind is OpKind.RECV_F and key not in self.arrived:
            self.posted_at[rank] = self.pos[rank]
            return key
        if action.kind in RECV_KINDS and key in self.arrived:
            self.local[rank].add(key)
        return None

    def compute(self, rank: int, action: Action) -> deps.Key | None:
        """Run a compute action whose inputs are all here; else the first one missing."""
        here, ends = self.local[rank], self.ends
        for key in deps.requires(action, self.per_chain):
            if key in here:
                continue
            if key in ends and ends[key][1] == rank and key in self.arrived:
                here.add(key)
                continue
            if key not in ends:
                raise ScheduleError(
                    f"rank {rank} step {self.pos[rank]}: {action} needs "
                    f"{describe_key(key, self.program.placement)}, which nothing before it brings",
                    self.program,
                    [(rank, self.pos[rank])],
                )
            return key
        here.update(deps.produces(action))
        return None

    def post(self, rank: int, key: deps.Key) -> None:
        sender, receiver = self.ends[key]
        stream = self.streams.setdefault((rank, receiver > sender), deque())
        stream.append(key)
        if len(stream) == 1:
            self.first_in_line(key)

    def first_in_line(self, key: deps.Key) -> None:
        """One half of ``key``'s transfer is first in its stream; with both, it runs, and the
        transfers behind it move up (iteratively: one can set off a long cascade)."""
        todo = [key]
        while todo:
            key = todo.pop()
            self.halves_first[key] = self.halves_first.get(key, 0) + 1
            if self.halves_first[key] < 2:
                continue
            del self.halves_first[key]
            self.arrived.add(key)
            self.work.extend(self.parked.pop(key, ()))
            sender, receiver = self.ends[key]
            for end in (sender, receiver):
                stream = self.streams[end, receiver > sender]
                stream.popleft()
                if stream:
                    todo.append(stream[0])
