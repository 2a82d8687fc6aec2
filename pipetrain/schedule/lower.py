"""Lowering: an ordered list of named passes from a compute-only program to a runnable one.

The one pass today, ``inject_comms``, adds a SEND/RECV pair for every value that crosses ranks
(``deps.crosses_ranks``). It first runs the program in dependency order with unit durations
(``execute.run``), which yields one global, time-ordered sequence of every rank's actions; each
value produced for another rank becomes a SEND right after its producer and the matching RECV on
the receiver at the same instant, adjacent in that sequence. Hence:

* every SEND follows its producer and every RECV precedes its consumer, and receives sit where the
  unit-time run says the value arrives — early, so the runtime can post them ahead of need;
* for any two ranks, transfers between them appear in the same order on both ends (NCCL's
  per-peer stream never crosses, the hang of Megatron #5100);
* executing in the global order completes with blocking (rendezvous) P2P — the first unexecuted
  action of that order is always runnable — and so also with batched P2P.

A program that cannot run raises ``ScheduleError`` naming who waits on whom (d9d injects comms
the same way, docs/design.md habit 1).

``post_receives_late`` is an optional pass on a lowered program: it moves each RECV later, to at
most ``lead`` compute actions before the one that reads it. The unit-time run places receives
where a value *could* arrive, up to several actions before it is read; on NCCL a posted receive
is a kernel resident on the GPU until its data comes, holding SMs that the compute beside it
lacks. Megatron-Core's interleaved schedule posts each receive one compute action ahead of its
use (``overlap_p2p_comm``), which is ``lead=1``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import add, attrgetter, mul

from pipetrain.schedule import deps
from pipetrain.schedule.action import RECV_KINDS, Action, OpKind
from pipetrain.schedule.execute import run, unit_duration
from pipetrain.schedule.gc_pause import without_gc
from pipetrain.schedule.program import Program, ScheduleError

_kind_stage = attrgetter("kind", "stage")


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Program], Program]


def inject_comms(program: Program) -> Program:
    """Add SEND/RECV actions for every cross-rank dependency (see the module docstring)."""
    if program.is_lowered:
        raise ScheduleError("program already carries SEND/RECV actions; lower a compute-only one")
    # what each (kind, stage) at micro-batch 0 sends: (send kind, stage, recv kind, stage, rank)
    transfers_of = {
        kind: {
            stage: tuple(
                (t.send.kind, t.send.stage, t.recv.kind, t.recv.stage, t.recv_rank)
                for t in transfers
            )
            for stage, transfers in of_stage.items()
        }
        for kind, of_stage in deps.compile_rule(program.placement).transfers.items()
    }
    # The global order sorts by (time, 0 = transfer before 1 = compute, producer's rank, execution
    # order). Each rank's row is that order restricted to the row, so each row is sorted on its
    # own, by one number: unit durations make every time an integer, so (time, flag, rank) packs
    # into ``(2·time + flag)·ranks + rank``, and the sort is stable, which keeps execution order.
    # Two entries of a row share a number only if one action sent both, so a row may be filled
    # in any order that keeps each action's transfers in order: its compute actions all at once
    # (their numbers read in C), then the transfers.
    num_ranks = program.num_ranks
    keys: list[list[float]] = [[] for _ in range(num_ranks)]
    rows: list[list[Action]] = [[] for _ in range(num_ranks)]
    unit_run = run(program, unit_duration)
    flat = {
        (kind, stage): transfers
        for kind, of_stage in transfers_of.items()
        for stage, transfers in of_stage.items()
    }
    key_appends, row_appends = [k.append for k in keys], [r.append for r in rows]
    for rank in range(num_ranks):
        own_keys, own_row, row = keys[rank], rows[rank], unit_run.rows[rank]
        own_row += row
        # (2·start + 1)·ranks + rank, in C
        own_keys += map(
            add, map(mul, unit_run.starts[rank], repeat(2 * num_ranks)), repeat(num_ranks + rank)
        )
        key_append, row_append = own_keys.append, own_row.append
        for action, end, transfers in zip(
            row, unit_run.ends[rank], map(flat.get, map(_kind_stage, row))
        ):
            if not transfers:
                if transfers is None:  # an overlapped pair: its parts' transfers, in order
                    for part in action.parts:
                        _add_transfers(
                            keys, rows, rank, end, part.microbatch, flat[part.kind, part.stage]
                        )
                continue
            # each transfer's SEND here and RECV on the receiver, both numbered by ``end``
            sent, microbatch = 2 * end * num_ranks + rank, action.microbatch
            for send, send_stage, recv, recv_stage, recv_rank in transfers:
                key_append(sent)
                row_append(Action(send, send_stage, microbatch))
                key_appends[recv_rank](sent)
                row_appends[recv_rank](Action(recv, recv_stage, microbatch))
    return program.with_actions(
        map(row.__getitem__, sorted(range(len(row)), key=row_keys.__getitem__))
        for row, row_keys in zip(rows, keys)
    )


def _add_transfers(
    keys: list[list[float]],
    rows: list[list[Action]],
    rank: int,
    end: float,
    microbatch: int,
    transfers: tuple[tuple[OpKind, int, OpKind, int, int], ...],
) -> None:
    """Each transfer of a value made on ``rank`` at ``end``: its SEND there, its RECV on the
    receiver, both numbered by ``end`` (``inject_comms``)."""
    sent = 2 * end * len(rows) + rank
    own_keys, own_row = keys[rank], rows[rank]
    for send, send_stage, recv, recv_stage, recv_rank in transfers:
        own_keys.append(sent)
        own_row.append(Action(send, send_stage, microbatch))
        keys[recv_rank].append(sent)
        rows[recv_rank].append(Action(recv, recv_stage, microbatch))


def post_receives_late(program: Program, lead: int) -> Program:
    """Move every RECV to at most ``lead`` compute actions before the compute action that reads it.

    A receive never moves earlier, never past its reader, and never past a later transfer of its
    own *stream*: on a rank, the transfers whose data flows towards higher ranks (sends to higher
    ranks, receives from lower ones) form one stream, those flowing down the other — the two
    process groups of ``runtime.comm.p2p``, whose operations a backend may run one after the other
    in posting order (one NCCL communicator per group). So each stream keeps the order lowering
    gave it, in particular receives from one peer keep their order, and only compute actions
    and the other stream's transfers are passed. Sends stay where they are. The result is checked
    like any program, with the runtime transport's model (``validate(..., "posted")``).
    """
    if isinstance(lead, bool) or not isinstance(lead, int) or lead < 0:
        raise ValueError(f"a receive's lead is a number of compute actions >= 0, got {lead!r}")
    if not program.is_lowered and program.num_ranks > 1:  # one rank: nothing to receive
        raise ScheduleError(
            "post_receives_late moves the receives of a lowered program; lower first"
        )
    per_chain = program.placement.stages_per_chain
    rank_of = program.placement.rank
    rows = []
    for rank, row in enumerate(program.actions):
        # slot k: the run of transfers just before the row's k-th compute action (k = the number
        # of compute actions before it); the row's end is the last slot
        slot_of: list[int] = []
        readers: dict[deps.Key, int] = {}  # value -> slot of the compute action reading it
        slots = 0
        for action in row:
            slot_of.append(slots)
            if action.is_compute:
                for key in deps.requires(action, per_chain):
                    readers.setdefault(key, slots)
                slots += 1
        target = list(slot_of)
        nearest_later: dict[bool, int] = {}  # stream (flows up?) -> slot of its next transfer
        for i in range(len(row) - 1, -1, -1):
            action = row[i]
            if not action.is_comm:
                continue
            peer = rank_of(deps.peer(action).stage)
            receives = action.kind in RECV_KINDS
            up = rank > peer if receives else peer > rank
            if receives:
                late = readers.get(deps.comm_key(action), slot_of[i] + lead) - lead
                target[i] = max(slot_of[i], min(late, nearest_later.get(up, late)))
            nearest_later[up] = target[i]
        order = sorted(range(len(row)), key=lambda i: (target[i], not row[i].is_comm, i))
        rows.append([row[i] for i in order])
    return program.with_actions(rows)


PASSES: tuple[Pass, ...] = (Pass("inject_comms", inject_comms),)


@without_gc
def lower(program: Program, passes: Sequence[Pass] = PASSES) -> Program:
    """Apply the passes in order. A program that already has comms is returned as it is."""
    if program.is_lowered:
        return program
    for p in passes:
        program = p.run(program)
    return program
