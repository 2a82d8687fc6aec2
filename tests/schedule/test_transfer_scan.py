"""Validation's row scan in integers (``transfer_scan._scan_row``) against the action-by-action
scan it falls back to: the same posts, batches and channel lists on every family's lowered
program, and never a pass where the exact scan finds a fault, on programs broken at random; the
plain event loop's value table against far-off micro-batches."""

from __future__ import annotations

import random

import pytest

from pipetrain.schedule import transfer_scan
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.execute import run, unit_duration
from pipetrain.schedule.lower import lower
from pipetrain.schedule.placement import one_per_rank
from pipetrain.schedule.posted_p2p import check_channels
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.schedule.validate import validate


def _lowered(name: str) -> Program:
    ranks = 2 if name == "dualpipe" else 3
    return lower(build_schedule(name, ranks, 6))


def _exact(program: Program, monkeypatch: pytest.MonkeyPatch) -> transfer_scan.Scans | None:
    """``scan_lowered`` with every row read action by action."""
    with monkeypatch.context() as patch:
        patch.setattr(transfer_scan, "_scan_row", lambda *_: None)
        return transfer_scan.scan_lowered(program)


def _fields(scans: transfer_scan.Scans) -> list[tuple[object, ...]]:
    return [(s.posts, s.batched, s.offsets, s.first_steps, s.failing_batch) for s in scans.rows]


@pytest.mark.parametrize("name", [str(name) for name in FAMILIES])
def test_the_integer_scan_reads_every_family_as_the_exact_scan(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = validate(_lowered(name))
    fast, exact = transfer_scan.scan_lowered(program), _exact(program, monkeypatch)
    assert fast is not None and exact is not None
    assert fast.channels_filled and not exact.channels_filled
    assert _fields(fast) == _fields(exact)
    assert all(s.failing_batch == -1 for s in fast.rows)
    # the channel lists the scan filled are the ones the rows give when read on their own
    assert fast.channels.check() == check_channels(program)


def _broken(program: Program, rng: random.Random) -> Program:
    """One row changed: two neighbours swapped, an action dropped, or one repeated."""
    rows = [list(row) for row in program.actions]
    row = rows[rng.randrange(len(rows))]
    i = rng.randrange(len(row) - 1)
    match rng.randrange(3):
        case 0:
            row[i], row[i + 1] = row[i + 1], row[i]
        case 1:
            del row[i]
        case _:
            row.insert(i, row[i])
    return program.with_actions(rows)


@pytest.mark.parametrize("name", ["1f1b", "zbv", "interleaved-zb", "dualpipe"])
def test_a_broken_row_passes_the_integer_scan_only_where_the_exact_scan_passes_it(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(name)
    program = _lowered(name)
    faults = 0
    for _ in range(60):
        broken = _broken(program, rng)
        if not broken.is_lowered:
            continue
        fast, exact = transfer_scan.scan_lowered(broken), _exact(broken, monkeypatch)
        assert (fast is None) == (exact is None)
        if fast is None or exact is None:
            continue
        assert _fields(fast) == _fields(exact)
        faults += any(s.failing_batch >= 0 for s in exact.rows)
        if fast.channels_filled:  # every row passed: the exact scan found nothing either
            assert all(s.failing_batch == -1 for s in exact.rows)
    assert faults > 0  # the mutations did reach the exact scan's failures


def test_a_swapped_pair_of_sends_is_refused_as_an_order_mismatch() -> None:
    program = lower(build_schedule("1f1b", 2, 4))
    row = list(program.actions[0])
    sends = [i for i, a in enumerate(row) if a.kind is OpKind.SEND_F]
    row[sends[0]], row[sends[1]] = row[sends[1]], row[sends[0]]
    swapped = program.with_actions([row, *program.actions[1:]])
    with pytest.raises(ScheduleError, match="same order on both ends|needs|sends a value"):
        validate(swapped)


def test_far_off_microbatches_run_on_a_sparse_value_table() -> None:
    """The plain loop keeps values in a list sized by the micro-batches' span; a program naming
    a micro-batch far beyond its count (unvalidated input) runs on a dict instead, to the same
    order."""
    far = 10**9
    rows = ((Action(OpKind.F, 0, far), Action(OpKind.B, 0, far)),)
    program = Program(one_per_rank(1), 1, rows)
    ran = run(program, unit_duration)
    assert ran.starts == [[0.0, 1.0]] and ran.ends == [[1.0, 2.0]]
