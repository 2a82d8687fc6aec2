"""Offload as data: ``insert_offload`` keeps every family's programs valid and deadlock-free
(compute-only and lowered, blocking and posted transport, receives posted late), every OFFLOAD
has exactly one RELOAD before the backward that reads it, the validator refuses copies out of
order, and the simulator's copy engine times them (PipeOffload, arXiv 2503.01328)."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.action import Action, OpKind, parse_action
from pipetrain.schedule.lower import lower, post_receives_late
from pipetrain.schedule.offload import insert_offload, offloadable_stages
from pipetrain.schedule.program import ScheduleError
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate


def _copies(program):
    found: dict[OpKind, list[tuple[int, int]]] = {OpKind.OFFLOAD: [], OpKind.RELOAD: []}
    for row in program.actions:
        for a in row:
            if a.kind in found:
                found[a.kind].append((a.stage, a.microbatch))
    return found


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(list(FAMILIES)),
    p=st.integers(1, 8),
    v=st.integers(1, 3),
    m=st.integers(1, 24),
    lead=st.integers(0, 3),
    fraction=st.floats(0.05, 1.0),
    copy=st.floats(0.0, 3.0),
)
def test_offload_keeps_every_family_valid(name, p, v, m, lead, fraction, copy) -> None:
    try:
        program = build_schedule(name, p, m, v if FAMILIES[name].multi_stage else None)
    except ValueError:
        return
    stages = offloadable_stages(program, lead)
    fractions = [fraction if s in stages else 0.0 for s in range(program.num_stages)]
    lowered = validate(lower(program))
    for base in (program, lowered):
        offloaded = validate(insert_offload(base, fractions, lead))
        copies = _copies(offloaded)
        assert sorted(copies[OpKind.OFFLOAD]) == sorted(copies[OpKind.RELOAD])
        assert len(set(copies[OpKind.OFFLOAD])) == len(copies[OpKind.OFFLOAD])
        assert {s for s, _ in copies[OpKind.OFFLOAD]} == stages
        assert offloaded.compute_only() == base.compute_only()
    offloaded = insert_offload(lowered, fractions, lead)
    validate(offloaded, "posted")
    validate(post_receives_late(offloaded, lead), "posted")
    plain = simulate(lowered)
    free = simulate(offloaded, Costs(offload=fractions))  # copies take no time
    assert free.makespan == pytest.approx(plain.makespan)
    assert all(a <= b + 1e-9 for a, b in zip(free.peak_activations, plain.peak_activations))
    slow = simulate(offloaded, Costs(offload=fractions, host_copy=copy))
    assert slow.makespan >= plain.makespan - 1e-9  # copies can only delay a backward
    assert len(slow.copies) == 2 * len(copies[OpKind.OFFLOAD])


def test_copies_round_trip_in_the_text_notation() -> None:
    for text in ("0OFFLOAD3", "2RELOAD11"):
        assert str(parse_action(text)) == text
    assert parse_action("1OFFLOAD0") == Action(OpKind.OFFLOAD, 1, 0)


def _one_f_one_b():
    return lower(build_schedule("1f1b", 4, 8))


def _with_row(program, rank, row):
    rows = list(program.actions)
    rows[rank] = tuple(row)
    return program.with_actions(rows)


def test_a_reload_after_its_backward_is_refused() -> None:
    program = insert_offload(_one_f_one_b(), [1.0, 0.0, 0.0, 0.0])
    row = list(program.actions[0])
    reload = row.index(Action(OpKind.RELOAD, 0, 0))
    backward = row.index(Action(OpKind.B, 0, 0))
    row.insert(backward, row.pop(reload))  # now right after the backward
    with pytest.raises(ScheduleError, match="offloaded and not reloaded before it"):
        validate(_with_row(program, 0, row))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("drop reload", "offloaded and not reloaded before it"),
        ("reload twice", "must come after its OFFLOAD"),
        ("reload first", "must come after its OFFLOAD"),
        ("offload twice", "must come after its forward"),
    ],
)
def test_copies_out_of_order_are_refused(change, message) -> None:
    program = insert_offload(_one_f_one_b(), [1.0, 0.0, 0.0, 0.0])
    row = list(program.actions[0])
    offload, reload = Action(OpKind.OFFLOAD, 0, 0), Action(OpKind.RELOAD, 0, 0)
    match change:
        case "drop reload":
            row.remove(reload)
        case "reload twice":
            row.insert(row.index(reload), reload)
        case "reload first":
            row.remove(reload)
            row.insert(0, reload)
        case "offload twice":
            row.insert(row.index(offload), offload)
    with pytest.raises(ScheduleError, match=message):
        validate(_with_row(program, 0, row))


@pytest.mark.parametrize(
    ("fractions", "message"),
    [
        ([1.5, 0.0, 0.0, 0.0], r"offload fraction of stage 0 must be a number in \[0, 1\]"),
        ([-0.1, 0.0, 0.0, 0.0], r"must be a number in \[0, 1\]"),
        ([0.5], "give one per stage"),
        ([0.0, 0.0, 0.0, 0.5], "nothing to offload"),
    ],
)
def test_bad_fractions_are_refused(fractions, message) -> None:
    with pytest.raises(ValueError, match=message):
        insert_offload(_one_f_one_b(), fractions)


def test_the_copy_engine_queues_by_direction_and_backwards_wait_for_reloads() -> None:
    program = insert_offload(lower(build_schedule("1f1b", 4, 8)), [1.0, 1.0, 1.0, 0.0])
    fast = simulate(program, Costs(offload=[1, 1, 1, 0], host_copy=0.1))
    plain = simulate(lower(build_schedule("1f1b", 4, 8)))
    assert fast.makespan == pytest.approx(plain.makespan)  # hidden behind compute
    assert fast.peak_activations[0] < plain.peak_activations[0]
    slow = simulate(program, Costs(offload=[1, 1, 1, 0], host_copy=4.0))
    assert slow.makespan > plain.makespan
    for rank in range(4):
        for kind in (OpKind.OFFLOAD, OpKind.RELOAD):
            spans = sorted(
                (s for s in slow.copies if s.rank == rank and s.action.kind is kind),
                key=lambda s: s.start,
            )
            assert all(a.end <= b.start + 1e-9 for a, b in pairwise(spans))  # one queue
    reload_end = {(s.rank, s.action.microbatch): s.end for s in slow.copies
                  if s.action.kind is OpKind.RELOAD}  # fmt: skip
    for span in slow.spans:
        if span.action.kind is OpKind.B and (span.rank, span.action.microbatch) in reload_end:
            assert span.start >= reload_end[span.rank, span.action.microbatch] - 1e-9


def test_programs_with_copies_round_trip_through_files(tmp_path) -> None:
    from pipetrain.schedule.program_io import load_program, save_program

    program = insert_offload(_one_f_one_b(), [1.0, 1.0, 1.0, 0.0])
    for ext in ("csv", "json"):
        path = tmp_path / f"program.{ext}"
        save_program(program, path)
        loaded = validate(load_program(path))
        assert loaded.actions == program.actions and loaded.placement == program.placement
