"""Lowering and validation: comm injection, pairing, deadlocks drawn with who waits on whom."""

from __future__ import annotations

import pytest

from pipetrain.schedule import deps
from pipetrain.schedule.action import Action, OpKind
from pipetrain.schedule.builders.gpipe import build_gpipe
from pipetrain.schedule.builders.one_f_one_b import build_1f1b
from pipetrain.schedule.lower import lower, post_receives_late
from pipetrain.schedule.placement import one_per_rank
from pipetrain.schedule.program import Program, ScheduleError
from pipetrain.schedule.program_io import from_csv
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.validate import validate


def F(s, j):
    return Action(OpKind.F, s, j)


def B(s, j):
    return Action(OpKind.B, s, j)


def test_lowering_adds_one_pair_per_crossing_value() -> None:
    p, m = 4, 6
    lowered = validate(lower(build_1f1b(p, m)))
    counts = lowered.count()
    assert counts["SEND_F"] == counts["RECV_F"] == (p - 1) * m
    assert counts["SEND_B"] == counts["RECV_B"] == (p - 1) * m
    # a send follows its producer; a receive precedes its consumer
    for row in lowered.actions:
        for i, a in enumerate(row):
            if a.kind is OpKind.SEND_F:
                assert F(a.stage, a.microbatch) in row[:i]
            if a.kind is OpKind.RECV_F:
                assert F(a.stage, a.microbatch) in row[i:]


def test_transfers_between_two_ranks_are_in_the_same_order_on_both_ends() -> None:
    lowered = lower(build_1f1b(4, 8))
    for r in range(3):
        sent = [(a.kind, a.microbatch) for a in lowered.actions[r] if a.kind is OpKind.SEND_F]
        got = [(a.kind, a.microbatch) for a in lowered.actions[r + 1] if a.kind is OpKind.RECV_F]
        assert [m for _, m in sent] == [m for _, m in got]
        # and both directions interleave identically (one NCCL stream per peer pair)
        down = [a for a in lowered.actions[r] if a.kind in (OpKind.SEND_F, OpKind.RECV_B)]
        up = [a for a in lowered.actions[r + 1] if a.kind in (OpKind.RECV_F, OpKind.SEND_B)]
        assert [(a.kind is OpKind.SEND_F, a.microbatch) for a in down] == [
            (a.kind is OpKind.RECV_F, a.microbatch) for a in up
        ]


def test_lower_is_idempotent_and_compute_only_inverts_it() -> None:
    program = build_gpipe(3, 4)
    lowered = lower(program)
    assert lower(lowered) is lowered
    assert lowered.compute_only() == program


def _program(rows) -> Program:
    return Program(
        one_per_rank(len(rows)),
        1 + max(a.microbatch for r in rows for a in r),
        tuple(map(tuple, rows)),
    )


def test_missing_backward_is_refused_with_the_cell_marked() -> None:
    with pytest.raises(
        ScheduleError, match=r"stage 1 micro-batch 0 needs exactly one F .* found 1 F, 0 B"
    ):
        validate(_program([[F(0, 0), B(0, 0)], [F(1, 0)]]))


def test_action_on_the_wrong_rank() -> None:
    with pytest.raises(ScheduleError, match="runs stage 1, which lives on rank 1") as e:
        validate(_program([[F(0, 0), F(1, 0), B(0, 0)], [B(1, 0)]]))
    assert ">1F0<" in str(e.value)


def test_deadlock_names_who_waits_on_whom_and_draws_the_grid() -> None:
    # rank 0 wants the backward of micro-batch 0 before it has sent any forward
    rows = [[F(0, 1), B(0, 0), F(0, 0), B(0, 1)], [F(1, 0), B(1, 0), F(1, 1), B(1, 1)]]
    with pytest.raises(ScheduleError) as e:
        validate(_program(rows))
    text = str(e.value)
    assert "deadlock" in text
    assert "rank 0 step 1: 0B0 waits for 0F0 on rank 0, 1B/I0 on rank 1" in text
    assert "rank 1 step 0: 1F0 waits for 0F0 on rank 0" in text
    assert ">0B0<" in text and ">1F0<" in text


def test_lowered_program_with_crossed_blocking_sends_deadlocks() -> None:
    # rank 0 waits for a gradient before sending the forward that produces it
    text = (
        "0F0,0RECV_B0,0F1,0SEND_F0,0SEND_F1,0B0,0RECV_B1,0B1\n"
        "1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n"
    )
    with pytest.raises(ScheduleError, match="0RECV_B0 waits for 1SEND_B0 on rank 1"):
        validate(from_csv(text))


def test_lowered_program_checks_pairing() -> None:
    good = lower(build_1f1b(2, 2))
    rows = [list(r) for r in good.actions]
    rows[1] = [a for a in rows[1] if a != Action(OpKind.RECV_F, 1, 1)]
    with pytest.raises(ScheduleError, match="missing communication actions: 1RECV_F1"):
        validate(good.with_actions(rows))
    rows = [list(r) for r in good.actions]
    rows[0].insert(0, Action(OpKind.SEND_B, 0, 0))
    with pytest.raises(ScheduleError, match="0SEND_B0 moves a value that never crosses ranks"):
        validate(good.with_actions(rows))


def test_send_before_its_value_exists() -> None:
    text = "0SEND_F0,0F0,0RECV_B0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n"
    with pytest.raises(ScheduleError, match="0SEND_F0 sends a value not yet computed here"):
        validate(from_csv(text))


def test_batched_comms_that_would_deadlock_one_by_one_pass() -> None:
    # rank 1 posts RECV_F1 and SEND_B0 together: fine batched, and what our lowering may emit
    text = (
        "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n"
        "1RECV_F0,1F0,1B0,1RECV_F1,1SEND_B0,1F1,1B1,1SEND_B1\n"
    )
    validate(from_csv(text))


def _compute_gap(row, i, per_chain=4) -> int:
    """Compute actions between the receive at ``i`` and the compute action that reads it."""
    key = deps.comm_key(row[i])
    gap = 0
    for action in row[i + 1 :]:
        if action.is_compute:
            if key in deps.requires(action, per_chain):
                return gap
            gap += 1
    raise AssertionError(f"nothing reads {row[i]}")


@pytest.mark.parametrize("lead", [0, 1, 2])
def test_late_receives_sit_at_most_lead_computes_before_their_reader(lead) -> None:
    base = lower(build_schedule("interleaved-1f1b", 2, 8))
    late = post_receives_late(base, lead)
    for before, after in zip(base.actions, late.actions):
        assert [a for a in before if a.is_compute] == [a for a in after if a.is_compute]
        assert sorted(map(str, before)) == sorted(map(str, after))
        # sends keep their place among the compute actions; receives keep their order
        assert [(a, i) for i, a in _sends_after(before)] == [(a, i) for i, a in _sends_after(after)]
        recvs = [a for a in before if a.kind in (OpKind.RECV_F, OpKind.RECV_B)]
        assert recvs == [a for a in after if a.kind in (OpKind.RECV_F, OpKind.RECV_B)]
        for i, a in enumerate(after):
            if a.kind in (OpKind.RECV_F, OpKind.RECV_B):
                j = before.index(a)
                assert _compute_gap(after, i) <= max(lead, 0) or (
                    _compute_gap(after, i) == _compute_gap(before, j)
                )
                assert _compute_gap(after, i) <= _compute_gap(before, j)
    validate(late, "posted")
    if lead == 0:  # the blocking model would deadlock; the runtime's transport does not
        with pytest.raises(ScheduleError, match="deadlock"):
            validate(late)


def _sends_after(row):
    """Each SEND with the number of compute actions before it."""
    count = 0
    for a in row:
        if a.is_compute:
            count += 1
        elif a.kind in (OpKind.SEND_F, OpKind.SEND_B):
            yield count, a


def test_posted_model_finds_a_cross_rank_deadlock() -> None:
    # rank 1 wants micro-batch 1's forward before the backward rank 0 needs to produce it
    text = (
        "0F0,0SEND_F0,0RECV_B0,0B0,0F1,0SEND_F1,0RECV_B1,0B1\n"
        "1RECV_F0,1F0,1RECV_F1,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n"
    )
    with pytest.raises(ScheduleError, match="deadlock") as e:
        validate(from_csv(text), "posted")
    assert "rank 0 step 3: 0B0 waits for 1B/I0 on rank 1" in str(e.value)
    assert "rank 1 step 2: 1RECV_F1 waits for 0F1 on rank 0" in str(e.value)


@pytest.mark.parametrize("p2p", ["blocking", "posted"])
def test_transfers_in_another_order_on_the_two_ends_are_refused(p2p) -> None:
    # both sends in one batch, both receives in one: blocking batched P2P completes, but NCCL and
    # gloo match by position, so micro-batch 1 would land in micro-batch 0's buffer
    text = (
        "0F0,0F1,0SEND_F0,0SEND_F1,0RECV_B0,0RECV_B1,0B0,0B1\n"
        "1RECV_F1,1RECV_F0,1F0,1F1,1B0,1SEND_B0,1B1,1SEND_B1\n"
    )
    with pytest.raises(ScheduleError, match="same order on both ends") as e:
        validate(from_csv(text), p2p)
    assert "rank 1 receives 0F1 on rank 0 as transfer 0 from rank 0" in str(e.value)


def test_late_receives_refuse_bad_input() -> None:
    with pytest.raises(ValueError, match="lead is a number of compute actions >= 0, got -1"):
        post_receives_late(lower(build_1f1b(2, 2)), -1)
    with pytest.raises(ScheduleError, match="lower first"):
        post_receives_late(build_1f1b(2, 2), 1)
    with pytest.raises(ValueError, match="p2p must be one of blocking, posted"):
        validate(build_1f1b(2, 2), "eager")


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"])
def test_late_receives_keep_each_direction_in_order(name) -> None:
    """A rank's transfers flowing up (sends to higher ranks, receives from lower) keep their
    order, and so do those flowing down: a backend may run each direction's group as one stream."""
    base = lower(build_schedule(name, 4, 8))
    late = post_receives_late(base, 0)
    rank_of = base.placement.rank

    def streams(row, rank):
        out: dict[bool, list] = {True: [], False: []}
        for a in row:
            if a.is_comm:
                peer = rank_of(deps.peer(a).stage)
                receives = a.kind in (OpKind.RECV_F, OpKind.RECV_B)
                out[rank > peer if receives else peer > rank].append(a)
        return out

    moved = 0
    for rank, (before, after) in enumerate(zip(base.actions, late.actions)):
        assert streams(before, rank) == streams(after, rank)
        moved += before != after
    assert moved  # the pass did move receives (past compute actions and the other direction)
    validate(late, "posted")
