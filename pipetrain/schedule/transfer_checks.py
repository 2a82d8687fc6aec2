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
from operator import attrgetter
from typing import NamedTuple, TypeVar

from pipetrain.schedule import deps
from pipetrain.schedule.action import COPY_KINDS, SEND_KINDS, Action, OpKind
from pipetrain.schedule.execute import Wait, deadlock_error, describe_key
from pipetrain.schedule.plans import pair_shape
from pipetrain.schedule.program import Program, ScheduleError

# Pairing and execution of a lowered program work on *posts* (``deps.Post``): each SEND and RECV
# is an integer id, and each knows its counterpart's id; the rule's tables say which, at
# micro-batch 0.
#
# Execution splits in two. What a rank checks on its own — a compute action's inputs were computed
# or received earlier on the rank, a SEND's value was computed before its batch is posted — depends
# on that row alone, so one pass per row (``_scan_row``) finds the first such failure and the
# row's batches. What ranks wait for — each batch's counterparts — is then played batch by batch,
# and a rank that reaches its row's first failure raises it there: the same failure, in the same
# order, as playing every action.


_T = TypeVar("_T")
_kind_stage = attrgetter("kind", "stage")
_microbatch = attrgetter("microbatch")


class _Step(NamedTuple):
    """A compute action's (values needed, values made) at its micro-batch's 0 (add
    ``microbatch · stride``)."""

    needs: Sequence[int]
    made: Sequence[int]


@dataclass(frozen=True, slots=True)
class _RowScan:
    """One rank's row of a lowered program, read on its own.

    Integers, in lists and tuples of integers only: a row holds ~10^4 batches, and the garbage
    collector stops tracking a tuple of integers, while every tracked object that lives on makes
    it walk the program's ~10^5 actions again sooner. For the same reason a batch holds plain
    ``(post, counterpart)`` pairs, not ``deps.Post`` records.
    """

    #: ids of the row's SEND/RECV posts, in row order
    posts: list[int]
    #: each batch's (post id, counterpart id) pairs, up to the row's first failure; the last batch
    #: is an empty one at the row's end, where a rank arrives once its last real batch completes
    batches: list[tuple[tuple[int, int], ...]]
    #: the step at which each batch starts (the last: ``len(row)``)
    first_steps: list[int]
    #: the batch at whose arrival the row's first own failure is raised (-1: none), and the error
    failing_batch: int
    failure: Callable[[], ScheduleError] | None


def scan_lowered(program: Program) -> list[_RowScan] | None:
    """Each row's scan, or None if a SEND/RECV moves a value that cannot exist (e.g. RECV_F on
    stage 0); placement has been checked, so every stage is in range."""
    rule = deps.compile_rule(program.placement)
    # a compute action's needs and made values at micro-batch 0
    steps = {
        kind: {
            stage: _Step(tuple(need.value for need in needs), rule.awaited[kind][stage])
            for stage, needs in needs_of_stage.items()
        }
        for kind, needs_of_stage in rule.needs.items()
    }
    for kind in COPY_KINDS:  # a copy waits for no value here and closes a batch, as compute does
        steps[kind] = {stage: _Step((), ()) for stage in range(program.num_stages)}
    # flat ``(kind, stage)`` tables of plain tuples: unpacking a ``NamedTuple`` takes CPython's
    # generic path, twice the cost of a tuple's, once per action
    flat_posts = {
        key: (p.id, p.counterpart, p.value, p.is_send) for key, p in _flat(rule.posts).items()
    }
    flat_steps = {key: (step.needs, step.made) for key, step in _flat(steps).items()}
    scans = []
    for rank, row in enumerate(program.actions):
        scan = _scan_row(program, rank, row, rule, steps, flat_posts, flat_steps)
        if scan is None:
            return None
        scans.append(scan)
    return scans


def _scan_row(
    program: Program,
    rank: int,
    row: Sequence[Action],
    rule: deps.CompiledRule,
    steps: dict[OpKind, dict[int, _Step]],
    flat_posts: dict[tuple[OpKind, int], tuple[int, int, int, bool]],
    flat_steps: dict[tuple[OpKind, int], tuple[Sequence[int], Sequence[int]]],
) -> _RowScan | None:
    """Posts, batches and the first failure of one row (``steps`` at micro-batch 0, also as
    ``flat_steps``; ``flat_posts`` the rule's posts)."""
    stride, post_stride = rule.stride, rule.post_stride
    # each action's post (a SEND/RECV) or step (compute, a copy) at micro-batch 0, and its
    # micro-batch, read in C before the loop; an overlapped pair has neither (its parts do)
    kind_stages = list(map(_kind_stage, row))
    posts_of_row = list(map(flat_posts.get, kind_stages))
    steps_of_row: list[tuple[Sequence[int], Sequence[int]] | None]
    steps_of_row = list(map(flat_steps.get, kind_stages))
    microbatches = list(map(_microbatch, row))
    posts: list[int] = []
    batches: list[tuple[tuple[int, int], ...]] = []
    first_steps: list[int] = []
    batch: list[tuple[int, int]] = []  # the open batch (the run of SEND/RECV actions just read)
    landing: list[int] = []  # values the open batch receives: here once it completes
    mine: set[int] = set()  # values computed or received on this rank so far
    pair_steps: dict[tuple[object, ...], _Step] = {}  # by ``pair_shape``
    failing_batch: int = -1
    failure: Callable[[], ScheduleError] | None = None
    for index, post in enumerate(posts_of_row):
        if post is not None:  # a SEND or RECV
            post_id, counterpart, value, is_send = post
            microbatch = microbatches[index]
            shift = microbatch * post_stride
            post_id += shift
            posts.append(post_id)
            if failure is not None:
                continue  # past the row's first failure only the posts count (pairing)
            if not batch:
                first_steps.append(index)
            batch.append((post_id, counterpart + shift))
            value += microbatch * stride
            if not is_send:
                landing.append(value)
            elif value not in mine:
                failing_batch = len(first_steps) - 1
                failure = partial(_unsent_error, program, rank, index)
            continue
        step = steps_of_row[index]
        if step is None:
            action = row[index]
            if not action.parts:
                return None  # a SEND/RECV of a value that cannot exist
            shape = pair_shape(action)
            step = pair_steps.get(shape)
            if step is None:
                step = pair_steps[shape] = _pair_step(action, steps, stride)
        if failure is not None:
            continue
        if batch:  # the batch before this action completes before it
            batches.append(tuple(batch))
            batch.clear()
            mine.update(landing)
            landing.clear()
        needs, made = step
        shift = microbatches[index] * stride
        for value in needs:
            if value + shift not in mine:
                # nothing later can bring it: local values come from earlier actions
                failing_batch = len(first_steps)  # the rank gets here after the batch before
                failure = partial(_missing_input, program, rank, index, mine)
                break
        else:
            for value in made:
                mine.add(value + shift)
    if batch:
        batches.append(tuple(batch))
    first_steps.append(len(row))  # the empty last batch
    batches.append(())
    return _RowScan(posts, batches, first_steps, failing_batch, failure)


def _flat(table: dict[OpKind, dict[int, _T]]) -> dict[tuple[OpKind, int], _T]:
    """A ``[kind][stage]`` table keyed by ``(kind, stage)``, for one lookup per action."""
    return {
        (kind, stage): entry
        for kind, of_stage in table.items()
        for stage, entry in of_stage.items()
    }


def _pair_step(pair: Action, steps: dict[OpKind, dict[int, _Step]], stride: int) -> _Step:
    """An overlapped pair's (values needed, values made) at the pair's micro-batch, each part's
    shifted by its micro-batch's offset: every part's inputs must be here before the pair starts."""
    needs: list[int] = []
    made: list[int] = []
    for part in pair.parts:
        part_needs, part_made = steps[part.kind][part.stage]
        shift = (part.microbatch - pair.microbatch) * stride
        needs += [value + shift for value in part_needs]
        made += [value + shift for value in part_made]
    return _Step(needs, made)


def check_pairing(program: Program, scans: list[_RowScan] | None, chains: tuple[int, ...]) -> None:
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
        # whole sets and lengths are compared (C loops), never one post at a time
        shifts = {
            c: [j * rule.post_stride for j in range(m) if chains[j] == c]
            for c in range(placement.num_chains)
        }
        needed: set[int] = set()
        for send, recv, c in crossing:
            needed.update([send + shift for shift in shifts[c]])
            needed.update([recv + shift for shift in shifts[c]])
        posted: set[int] = set()
        for scan in scans:
            posted.update(scan.posts)
        if sum(len(scan.posts) for scan in scans) == len(needed) and posted == needed:
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


def execute_lowered(program: Program, scans: list[_RowScan]) -> None:
    """Blocking batched P2P: post a run of comms, wait until every counterpart is posted.

    Pairing has been checked, so each post is made once, by one rank. A rank that arrives at its
    row's failing batch (``_RowScan.failing_batch``) raises the row's first own failure.
    """
    rows = program.actions
    posted: set[int] = set()
    waiting: dict[int, list[int]] = {}  # counterpart id -> ranks parked on it
    next_batch = [0] * len(rows)
    work = list(range(len(rows) - 1, -1, -1))
    while work:
        rank = work.pop()
        scan = scans[rank]
        batches, b, failing_batch = scan.batches, next_batch[rank], scan.failing_batch
        while b < len(batches):
            if b == failing_batch:
                assert scan.failure is not None
                raise scan.failure()
            # Post everything, then wait on the first post whose counterpart is missing. One loop
            # does both: a batch never holds both halves of a transfer (they live on two ranks).
            unmatched = None
            for post, counterpart in batches[b]:
                if post not in posted:
                    posted.add(post)
                    if post in waiting:
                        work.extend(waiting.pop(post))
                if unmatched is None and counterpart not in posted:
                    unmatched = counterpart
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
        raise deadlock_error(program, _stuck_posts(program, pos, posted))


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
