"""Validation's reading of a lowered program's rows, each on its own (``validate`` steps 3 and 4).

Pairing and execution of a lowered program work on *posts* (``deps.Post``): each SEND and RECV is
an integer id, and its counterpart's id is the id with its lowest bit flipped (``deps``: the
RECV of value v is ``2·v``, its SEND ``2·v + 1``, and a micro-batch adds an even stride).

What a rank checks on its own — a compute action's inputs were computed or received earlier on
the rank, a SEND's value was computed before its batch is posted — depends on that row alone, so
one pass per row finds the first such failure, and the row's posts, its batches (runs of
consecutive SEND/RECV actions, posted at once) and each channel's values in order
(``posted_p2p.ChannelLists``). ``transfer_checks`` then plays the batches.

A row is read in two ways. ``_scan_row`` does it in integers, its columns (kinds, stages,
micro-batches, posts, batch bounds) read in C (``map``, ``compress``) and one plain loop for the
row's own order; a row it finds fault with is read again by ``_scan_row_exactly``, action by
action, which says where and why. Both hold the same rule (``deps``), so a row either passes
both or is refused by the second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import accumulate, compress, repeat
from operator import add, attrgetter, gt, is_not, mul, sub
from typing import NamedTuple, TypeVar

from pipetrain.schedule import deps
from pipetrain.schedule.action import COPY_KINDS, Action, OpKind
from pipetrain.schedule.execute import describe_key
from pipetrain.schedule.plans import pair_shape
from pipetrain.schedule.posted_p2p import ChannelLists
from pipetrain.schedule.program import Program, ScheduleError

_T = TypeVar("_T")
_kind_stage = attrgetter("kind", "stage")
_microbatch = attrgetter("microbatch")
_parts = attrgetter("parts")


class _Step(NamedTuple):
    """A compute action's (values needed, values made) at its micro-batch's 0 (add
    ``microbatch · stride``)."""

    needs: Sequence[int]
    made: Sequence[int]


@dataclass(frozen=True, slots=True)
class RowScan:
    """One rank's row of a lowered program, read on its own.

    Integers, in lists of integers only: a row holds ~10^4 batches, and every tracked object
    that lives on makes the garbage collector walk the program's ~10^5 actions again sooner.
    """

    #: ids of the row's SEND/RECV posts, in row order
    posts: list[int]
    #: the posts of the batches up to the row's first failure, in order: batch b is
    #: ``batched[offsets[b]:offsets[b + 1]]``; the last batch is an empty one at the row's end,
    #: where a rank arrives once its last real batch completes
    batched: list[int]
    offsets: list[int]
    #: the step at which each batch starts (the last: ``len(row)``)
    first_steps: list[int]
    #: the batch at whose arrival the row's first own failure is raised (-1: none), and the error
    failing_batch: int
    failure: Callable[[], ScheduleError] | None


@dataclass(frozen=True)
class Scans:
    """Every row's scan, and whether the channel lists were filled by them (``_scan_row``):
    then ``channels.check()`` is the channel-order check; otherwise it must read the rows."""

    rows: list[RowScan]
    channels: ChannelLists
    channels_filled: bool


def scan_lowered(program: Program) -> Scans | None:
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
    assert all(p[1] == p[0] ^ 1 for p in flat_posts.values()), "a counterpart is its id ^ 1"
    flat_steps = {key: (step.needs, step.made) for key, step in _flat(steps).items()}
    channels = ChannelLists(program)
    unsent: list[int] = []  # where a post's value never travels: its values go nowhere
    comms = {
        key: (channels.of_post.get(key, (unsent,))[0], value, is_send)
        for key, (_, _, value, is_send) in flat_posts.items()
    }
    post_ids = {key: post[0] for key, post in flat_posts.items()}
    scans, filled = [], True
    for rank, row in enumerate(program.actions):
        scan = _scan_row(row, rule, steps, post_ids, comms, flat_steps) if filled else None
        if scan is None:  # a fault in the row (or an earlier one): read it action by action
            filled = False
            scan = _scan_row_exactly(program, rank, row, rule, steps, flat_posts, flat_steps)
            if scan is None:
                return None
        scans.append(scan)
    return Scans(scans, channels, filled)


def _scan_row(
    row: Sequence[Action],
    rule: deps.CompiledRule,
    steps: dict[OpKind, dict[int, _Step]],
    post_ids: dict[tuple[OpKind, int], int],
    comms: dict[tuple[OpKind, int], tuple[list[int], int, bool]],
    flat_steps: dict[tuple[OpKind, int], tuple[Sequence[int], Sequence[int]]],
) -> RowScan | None:
    """The row's scan, each SEND/RECV's value appended to its channel's list (``comms``: per
    (kind, stage) the list, the value at micro-batch 0, and whether it sends); None at the first
    fault of any kind, which ``_scan_row_exactly`` then finds."""
    stride, size = rule.stride, len(row)
    kind_stages = list(map(_kind_stage, row))
    microbatches = list(map(_microbatch, row))
    steps_of_row = list(map(flat_steps.get, kind_stages))
    if any(map(_parts, row)):
        of_shape: dict[tuple[object, ...], _Step] = {}
        for index, action in enumerate(row):
            if action.parts:
                shape = pair_shape(action)
                if shape not in of_shape:
                    of_shape[shape] = _pair_step(action, steps, stride)
                steps_of_row[index] = of_shape[shape]
    mine: set[int] = set()  # values computed or received on this rank so far
    landing: list[int] = []  # values the open batch receives: here once a compute action comes
    for comm, step, microbatch in zip(map(comms.get, kind_stages), steps_of_row, microbatches):
        if comm is not None:
            to, value, is_send = comm
            value += microbatch * stride
            to.append(value)
            if not is_send:
                landing.append(value)
            elif value not in mine:
                return None
        elif step is not None:
            if landing:
                mine.update(landing)
                landing.clear()
            needs, made = step
            shift = microbatch * stride
            for value in needs:
                if value + shift not in mine:
                    return None
            for value in made:
                mine.add(value + shift)
        else:
            return None  # a SEND/RECV of a value that cannot exist
    # posts and batch bounds, read in C: a batch starts at a post after a non-post
    post0 = list(map(post_ids.get, kind_stages))
    is_post = list(map(is_not, post0, repeat(None)))
    posts = list(
        map(
            add,
            compress(post0, is_post),
            map(mul, compress(microbatches, is_post), repeat(rule.post_stride)),
        )
    )
    starts = list(compress(range(size), map(gt, is_post, [False, *is_post])))
    ends = compress(range(1, size + 1), map(gt, is_post, [*is_post[1:], False]))
    offsets = [0, *accumulate(map(sub, ends, starts))]
    offsets.append(offsets[-1])  # the empty last batch
    starts.append(size)
    return RowScan(posts, posts, offsets, starts, -1, None)


def _scan_row_exactly(
    program: Program,
    rank: int,
    row: Sequence[Action],
    rule: deps.CompiledRule,
    steps: dict[OpKind, dict[int, _Step]],
    flat_posts: dict[tuple[OpKind, int], tuple[int, int, int, bool]],
    flat_steps: dict[tuple[OpKind, int], tuple[Sequence[int], Sequence[int]]],
) -> RowScan | None:
    """The scan of a row ``_scan_row`` refuses, action by action, with its first failure
    (``steps`` at micro-batch 0, also as ``flat_steps``; ``flat_posts`` the rule's posts)."""
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
    return _flattened(posts, batches, first_steps, failing_batch, failure)


def _flattened(
    posts: list[int],
    batches: list[tuple[tuple[int, int], ...]],
    first_steps: list[int],
    failing_batch: int,
    failure: Callable[[], ScheduleError] | None,
) -> RowScan:
    """A ``RowScan`` from batches of (post, counterpart) pairs."""
    offsets = [0, *accumulate(map(len, batches))]
    batched = [post for batch in batches for post, _ in batch]
    return RowScan(posts, batched, offsets, first_steps, failing_batch, failure)


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
