"""Builder invariants for the split-backward families: zb-h1, zb-h2, zbv, dualpipev.

Sweeps (ranks 1–16, micro-batches 1–64) check that every program validates, is complete, and
meets its memory bound; unit-cost simulation pins the published facts (docs/schedules.md; Qi et al.
2024 Table 2; DeepSeek-V3 §3.2.1). ZBV and DualPipeV are also compared with
torch.distributed.pipelining's own orders when torch is installed.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.schedule.action import OpKind
from pipetrain.schedule.builders.dualpipev import build_dualpipev
from pipetrain.schedule.builders.zbv import build_zbv
from pipetrain.schedule.builders.zero_bubble import build_zb_h1, build_zb_h2
from pipetrain.schedule.lower import lower
from pipetrain.schedule.placement import PlacementKind
from pipetrain.schedule.program import Program
from pipetrain.schedule.validate import validate
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate

UNIT = Costs(forward=1, backward_input=1, backward_weight=1, comm=0)
SWEEP = settings(max_examples=60, deadline=None)
ranks = st.integers(1, 16)
microbatches = st.integers(1, 64)


def _parts(program: Program) -> Counter[tuple[OpKind, int, int]]:
    return Counter(
        (part.kind, part.stage, part.microbatch)
        for row in program.actions
        for action in row
        for part in action.compute_parts
    )


def _check_split_complete(program: Program) -> None:
    """Every (stage, micro-batch) has exactly one F, one I and one W, and nothing else."""
    expected = Counter(
        (kind, s, j)
        for kind in (OpKind.F, OpKind.I, OpKind.W)
        for s in range(program.num_stages)
        for j in range(program.num_microbatches)
    )
    assert _parts(program) == expected


# --- ZB-H1 ----------------------------------------------------------------------------------


@SWEEP
@given(ranks, microbatches)
def test_zb_h1_valid_complete_and_within_1f1b_memory(p: int, m: int) -> None:
    program = validate(build_zb_h1(p, m))
    assert program.name == "zb-h1" and program.placement.kind is PlacementKind.ONE_PER_RANK
    assert not program.is_lowered
    _check_split_complete(program)
    validate(lower(program))
    timeline = simulate(program, UNIT)
    assert max(timeline.peak_activations) <= min(p, m)
    # Table 2 at F = I = W: 3m + p − 1; with m < p the critical path (m + p − 1)(F + I) + W.
    expected = 3 * m + p - 1 if m >= p else 2 * (m + p - 1) + 1
    assert timeline.makespan == expected


@SWEEP
@given(ranks, st.integers(1, 64))
def test_zb_h1_w_follows_input_grad_of_microbatch_r_later(p: int, extra: int) -> None:
    m = p + extra - 1  # m >= p: the full lag opens on every rank
    for rank, row in enumerate(build_zb_h1(p, m).actions):
        texts = [str(a) for a in row]
        for j in range(m - rank):
            after = texts.index(f"{rank}I{j + rank}") + 1
            assert texts[after] == f"{rank}W{j}", (rank, j, texts)


def test_zb_h1_unit_facts_p4_m8() -> None:
    timeline = simulate(build_zb_h1(4, 8), UNIT)
    assert timeline.makespan == 27
    assert timeline.peak_activations == (4, 4, 4, 4)


# --- ZB-H2 ----------------------------------------------------------------------------------


@SWEEP
@given(ranks, microbatches)
def test_zb_h2_valid_complete_and_within_2p_minus_1(p: int, m: int) -> None:
    program = validate(build_zb_h2(p, m))
    assert program.name == "zb-h2" and program.placement.kind is PlacementKind.ONE_PER_RANK
    _check_split_complete(program)
    validate(lower(program))
    timeline = simulate(program, UNIT)
    assert max(timeline.peak_activations) <= min(2 * p - 1, m)
    if m >= 2 * p - 1:  # steady state reached: no bubble inside any rank's span
        assert timeline.rank_spans == (3 * m,) * p
        assert timeline.makespan == 3 * m + p - 1
        assert timeline.peak_activations == (2 * p - 1,) * p


def test_zb_h2_unit_facts_p4_m8() -> None:
    timeline = simulate(build_zb_h2(4, 8), UNIT)
    assert timeline.makespan == 27
    assert timeline.span == 24
    assert timeline.peak_activations[0] == 7


# --- ZBV ------------------------------------------------------------------------------------


@SWEEP
@given(ranks, microbatches)
def test_zbv_valid_complete_balanced(p: int, m: int) -> None:
    program = validate(build_zbv(p, m))
    assert program.name == "zbv" and program.placement.kind is PlacementKind.V
    assert program.num_stages == 2 * p
    _check_split_complete(program)
    validate(lower(program))
    timeline = simulate(program, UNIT)
    assert max(timeline.peak_activations) <= 2 * p
    if m >= 2 * p - 1:  # zero steady-state bubble: every rank's span is its work, 2 × 3m
        assert timeline.rank_spans == (6 * m,) * p
        assert timeline.peak_activations == (2 * p,) * p


def test_zbv_unit_facts_p4_m8() -> None:
    timeline = simulate(build_zbv(4, 8), UNIT)
    assert timeline.rank_spans == (48, 48, 48, 48)
    assert timeline.peak_activations == (8, 8, 8, 8)


# --- DualPipeV ------------------------------------------------------------------------------


@SWEEP
@given(ranks, microbatches)
def test_dualpipev_valid_or_refused(p: int, m: int) -> None:
    if m < 2 * p:
        with pytest.raises(
            ValueError, match=rf"num_microbatches >= 2 x num_ranks = {2 * p}, got {m}"
        ):
            build_dualpipev(p, m)
        return
    program = validate(build_dualpipev(p, m))
    assert program.name == "dualpipev" and program.placement.kind is PlacementKind.V
    validate(lower(program))
    parts = _parts(program)
    for s in range(2 * p):
        for j in range(m):
            assert parts[OpKind.F, s, j] == 1
            split = (parts[OpKind.I, s, j], parts[OpKind.W, s, j])
            assert (parts[OpKind.B, s, j], *split) in ((1, 0, 0), (0, 1, 1)), (s, j)
    timeline = simulate(program, UNIT)
    assert timeline.peak_activations == (2 * p + 1,) * p  # PP + 1 with PP = 2p stages


def test_dualpipev_overlapped_pairs_and_last_rank_turn() -> None:
    p, m = 4, 10
    program = build_dualpipev(p, m)
    for rank, row in enumerate(program.actions):
        pairs = [a for a in row if a.kind is OpKind.OVERLAP_F_B]
        assert all(b.kind is OpKind.B for _, b in (a.parts for a in pairs))
        step_4, step_5 = m - 2 * p + rank + 1, p - rank - 1
        unpaired_turn = 1 if rank == p - 1 else 0
        assert len(pairs) == 2 * step_4 - unpaired_turn + step_5
    last = [str(a) for a in program.actions[p - 1]]
    turn = last.index("3F4")  # the last rank's first main-step F0 is followed by a plain B1
    assert last[turn + 1] == "4B0"


# --- all four -------------------------------------------------------------------------------

BUILDERS = [build_zb_h1, build_zb_h2, build_zbv, build_dualpipev]


@pytest.mark.parametrize("builder", BUILDERS)
@pytest.mark.parametrize(("p", "m"), [(0, 8), (4, 0), (-1, 8), (True, 8), (4, 2.0)])
def test_bad_arguments_are_refused(builder, p, m) -> None:
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        builder(p, m)


# --- conformance with torch.distributed.pipelining ------------------------------------------


def _torch_orders(cls_name: str, p: int, m: int) -> list[list[str]]:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    cls = getattr(schedules, cls_name)
    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    return [
        [repr(a) for a in cls._calculate_single_rank_operations(fake, rank) if a is not None]
        for rank in range(p)
    ]


@pytest.mark.parametrize(("p", "m"), [(1, 1), (2, 3), (3, 2), (4, 8), (4, 5), (5, 17), (8, 16)])
def test_zbv_matches_torch(p: int, m: int) -> None:
    ours = [[str(a) for a in row] for row in build_zbv(p, m).actions]
    assert ours == _torch_orders("ScheduleZBVZeroBubble", p, m)


@pytest.mark.parametrize(("p", "m"), [(1, 2), (2, 4), (3, 7), (4, 8), (4, 11), (5, 10), (8, 20)])
def test_dualpipev_matches_torch(p: int, m: int) -> None:
    ours = [[str(a) for a in row] for row in build_dualpipev(p, m).actions]
    assert ours == _torch_orders("ScheduleDualPipeV", p, m)
