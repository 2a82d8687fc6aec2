"""Offload as data: ``insert_offload`` keeps every family's programs valid and deadlock-free
(compute-only and lowered, blocking and posted transport, receives posted late), every OFFLOAD
has exactly one RELOAD before the backward that reads it, the validator refuses copies out of
order, the simulator's copy engine times them (PipeOffload, arXiv 2503.01328), and reloads placed
just in time come as late as their copy allows — which, with layer-by-layer offload, lowers the
peak where moving whole micro-batches cannot."""

from __future__ import annotations

import dataclasses
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.action import Action, OpKind, parse_action
from pipetrain.schedule.lower import lower, post_receives_late
from pipetrain.schedule.offload import insert_offload, offloadable_stages, reload_leads
from pipetrain.schedule.program import ScheduleError
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import reload_timing, simulate


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


# -- the just-in-time rule --------------------------------------------------------------------


def _compute_positions(row):
    """Per (stage, mb): (compute index of its F, of its RELOAD's next compute action, of its
    first backward piece), for the micro-batches ``row`` offloads."""
    k, forward, reload, backward = 0, {}, {}, {}
    for action in row:
        if action.kind is OpKind.RELOAD:
            reload[action.stage, action.microbatch] = k
        elif action.is_compute:
            for part in action.compute_parts:
                key = (part.stage, part.microbatch)
                if part.kind is OpKind.F:
                    forward[key] = k
                elif part.kind in (OpKind.B, OpKind.I) and key not in backward:
                    backward[key] = (k, part)
            k += 1
    return {key: (forward[key], issue, *backward[key]) for key, issue in reload.items()}


@settings(max_examples=80, deadline=None)
@given(
    name=st.sampled_from(list(FAMILIES)),
    p=st.integers(1, 6),
    v=st.integers(1, 3),
    m=st.integers(1, 16),
    fraction=st.floats(0.05, 1.0),
    layers=st.integers(1, 5),
    copy=st.floats(0.0, 6.0),
    forward=st.floats(0.2, 2.0),
    backward_input=st.floats(0.2, 2.0),
)
def test_reloads_come_just_in_time(
    name, p, v, m, fraction, layers, copy, forward, backward_input
) -> None:
    """Every reload is issued as late as its copy allows — the compute actions between it and its
    backward last at least its ``need``, one action fewer would not — never before the action after
    its forward, and so never brings a second micro-batch back where waiting for the first's
    backward would have been enough; programs stay valid, and free copies change nothing but
    memory."""
    try:
        program = lower(build_schedule(name, p, m, v if FAMILIES[name].multi_stage else None))
    except ValueError:
        return
    n = program.num_stages
    costs = Costs(forward=forward, backward_input=backward_input, host_copy=copy, layers=layers,
                  offload=fraction)  # fmt: skip
    sc = costs.per_stage(n)
    timing = reload_timing(sc, n)
    able = offloadable_stages(program, 1, timing)
    fractions = [fraction if s in able else 0.0 for s in range(n)]
    if not any(fractions):
        return
    costs = Costs(forward=forward, backward_input=backward_input, host_copy=copy, layers=layers,
                  offload=fractions)  # fmt: skip
    timing = reload_timing(costs.per_stage(n), n)
    offloaded = validate(insert_offload(program, fractions, timing=timing))
    validate(post_receives_late(offloaded, 1), "posted")
    assert offloaded.compute_only() == program.compute_only()
    for row in offloaded.actions:
        compute = [a for a in row if a.is_compute]
        durations = [timing.duration(a) for a in compute]
        places = _compute_positions(row)
        for key, (f, issue, k, backward) in places.items():
            need = max(0.0, timing.need(backward))
            assert f + 2 <= issue <= k, (key, f, issue, k)
            covered = sum(durations[issue:k])
            assert covered >= need - 1e-9 or issue == f + 2, (key, covered, need)
            if issue < k:  # one action later would be late
                assert sum(durations[issue + 1 : k]) < need, (key, issue, k)
            for other, (_, other_issue, other_k, _) in places.items():
                if other != key and other_issue <= issue <= other_k < k:
                    # two micro-batches' reloads at once: only where waiting was too late
                    assert sum(durations[other_k + 1 : k]) < need, (key, other)
    plain = simulate(program)
    free = simulate(offloaded, dataclasses.replace(costs, host_copy=0.0, forward=1.0,
                                                   backward_input=1.0))  # fmt: skip
    assert free.makespan == pytest.approx(plain.makespan)
    assert all(a <= b + 1e-9 for a, b in zip(free.peak_activations, plain.peak_activations))
    # the fixed leads reload_leads records are at least as early for every micro-batch
    leads = reload_leads(program, fractions, timing)
    fixed = _compute_positions(insert_offload(program, fractions, leads).actions[0])
    for key, (_, issue, _, _) in _compute_positions(offloaded.actions[0]).items():
        if key in fixed:
            assert fixed[key][1] <= issue


def _peaks_and_makespan(program, costs, **insert):
    offloaded = validate(insert_offload(program, costs.offload, **insert))
    timeline = simulate(offloaded, costs)
    return timeline.makespan, timeline.peak_activations


def test_layer_by_layer_offload_lowers_the_peak_of_1f1b_on_two_ranks() -> None:
    """1F1B on 2 ranks holds two micro-batches on rank 0: moving one whole micro-batch after its
    forward cannot help (its reload lands while the next one's forward runs); moving it layer by
    layer, its first layers leave during its forward and only one comes back ahead of its
    backward, which leaves rank 0 with the last stage's one micro-batch."""
    program = lower(build_schedule("1f1b", 2, 8))
    plain = simulate(program)
    assert plain.peak_activations == (2.0, 1.0)
    whole = Costs(offload=[1.0, 0.0], host_copy=0.3)
    timing = reload_timing(whole.per_stage(2), 2)
    assert _peaks_and_makespan(program, whole, timing=timing)[1] == (2.0, 1.0)
    layered = dataclasses.replace(whole, layers=4)
    timing = reload_timing(layered.per_stage(2), 2)
    makespan, peaks = _peaks_and_makespan(program, layered, timing=timing)
    assert makespan == pytest.approx(plain.makespan) and peaks == (1.0, 1.0)
    # right before the backward would hold less, but every backward would wait for its first layer
    late, lower_peaks = _peaks_and_makespan(program, layered, lead=0)
    assert late > makespan and lower_peaks[0] < peaks[0]
    half = dataclasses.replace(layered, offload=[0.5, 0.0])
    timing = reload_timing(half.per_stage(2), 2)
    makespan, peaks = _peaks_and_makespan(program, half, timing=timing)
    assert makespan == pytest.approx(plain.makespan) and peaks == (1.25, 1.0)
    assert reload_leads(program, [0.5, 0.0], timing) == (0, 1)  # kept layers hide the reload


def test_just_in_time_reloads_avoid_the_wait_a_fixed_lead_pays() -> None:
    """Copies two forwards long under ZBV: one action ahead, backwards wait for their reloads;
    just in time, steady-state reloads start early enough and only the warm-up's wait."""
    program = lower(build_schedule("zbv", 2, 16))
    plain = simulate(program)
    slow = Costs(offload=[1.0, 1.0, 1.0, 0.0], host_copy=2.0)
    late, _ = _peaks_and_makespan(program, slow, lead=1)
    timing = reload_timing(slow.per_stage(4), 4)
    on_time, _ = _peaks_and_makespan(program, slow, timing=timing)
    assert late > 1.3 * plain.makespan and on_time < 1.1 * plain.makespan
    leads = reload_leads(program, slow.offload, timing)
    assert min(leads[:3]) >= 2
    # the fixed leads a plan records place every reload at least as early, as fast
    assert _peaks_and_makespan(program, slow, lead=leads)[0] == pytest.approx(on_time)


def test_a_bad_lead_is_refused() -> None:
    with pytest.raises(ValueError, match="reload lead has 3 values"):
        insert_offload(_one_f_one_b(), [1.0, 0.0, 0.0, 0.0], [1, 1, 1])
    with pytest.raises(ValueError, match="number of compute actions >= 0"):
        insert_offload(_one_f_one_b(), [1.0, 0.0, 0.0, 0.0], -1)
