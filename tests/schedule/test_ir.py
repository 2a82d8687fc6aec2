"""The IR: action notation round-trips, placements, programs and their files."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipetrain.schedule.action import COMPUTE_KINDS, Action, OpKind, overlap, parse_action
from pipetrain.schedule.builders.one_f_one_b import build_1f1b
from pipetrain.schedule.lower import lower
from pipetrain.schedule.placement import Placement, PlacementKind, infer_kind, looped, v_shape
from pipetrain.schedule.program_io import (
    from_csv,
    from_json,
    load_program,
    save_program,
    to_csv,
    to_json,
)

simple_kinds = [k for k in OpKind if k is not OpKind.OVERLAP_F_B]
simple_actions = st.builds(
    Action, st.sampled_from(simple_kinds), st.integers(0, 999), st.integers(0, 9999)
)
pairs = st.builds(
    lambda s1, m1, kind, s2, m2: overlap(Action(OpKind.F, s1, m1), Action(kind, s2, m2)),
    st.integers(0, 99),
    st.integers(0, 999),
    st.sampled_from([OpKind.B, OpKind.I]),
    st.integers(0, 99),
    st.integers(0, 999),
)


@given(st.one_of(simple_actions, pairs))
def test_notation_round_trips(action: Action) -> None:
    assert parse_action(str(action)) == action


def test_notation_matches_torch_examples() -> None:
    assert str(Action(OpKind.F, 2, 0)) == "2F0"
    assert str(Action(OpKind.SEND_F, 0, 3)) == "0SEND_F3"
    assert parse_action("1RECV_B2") == Action(OpKind.RECV_B, 1, 2)
    pair = parse_action("(0F7;7B3)OVERLAP_F_B")
    assert pair.kind is OpKind.OVERLAP_F_B
    assert pair.compute_parts == (Action(OpKind.F, 0, 7), Action(OpKind.B, 7, 3))
    assert pair.kind in COMPUTE_KINDS


@pytest.mark.parametrize(
    "text", ["", "F0", "0X1", "0F", "(0F1)OVERLAP_F_B", "(0B1;1F2)OVERLAP_F_B"]
)
def test_bad_notation_names_the_legal_forms(text: str) -> None:
    with pytest.raises(ValueError, match="expected|overlapped pair"):
        parse_action(text)


def test_placements() -> None:
    assert looped(2, 2).rank_of_stage == (0, 1, 0, 1)
    assert v_shape(3).rank_of_stage == (0, 1, 2, 2, 1, 0)
    assert v_shape(3).stages_of_rank(0) == (0, 5)
    assert infer_kind((0, 1, 1, 0), 2) is PlacementKind.V
    assert infer_kind((0, 1, 0, 1), 2) is PlacementKind.LOOPED
    assert infer_kind((1, 0), 2) is PlacementKind.EXPLICIT
    with pytest.raises(ValueError, match="hold no stage"):
        Placement((0, 0), 2)
    with pytest.raises(ValueError, match="legal ranks are 0..1"):
        Placement((0, 2), 2)


def test_program_files_round_trip(tmp_path) -> None:
    program = lower(build_1f1b(3, 5))
    assert from_csv(to_csv(program)).actions == program.actions
    back = from_json(to_json(program))
    assert back == program
    for name in ("p.csv", "p.json"):
        save_program(program, tmp_path / name)
        loaded = load_program(tmp_path / name)
        assert loaded.actions == program.actions
        assert loaded.placement.rank_of_stage == program.placement.rank_of_stage
        assert loaded.num_microbatches == 5


def test_csv_accepts_torch_bubbles() -> None:
    # torch's _dump_csv writes None bubbles as empty cells
    program = from_csv("0F0,,0B0\n,1F0,1B0\n")
    assert program.actions[0] == (Action(OpKind.F, 0, 0), Action(OpKind.B, 0, 0))
    assert program.num_stages == 2 and program.num_microbatches == 1


def test_bad_program_files(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read program file"):
        load_program(tmp_path / "missing.csv")
    (tmp_path / "bad.csv").write_text("0F0,0Q1\n")
    with pytest.raises(ValueError, match="line 1 .*cannot parse action '0Q1'"):
        load_program(tmp_path / "bad.csv")
    (tmp_path / "split.csv").write_text("0F0\n0B0\n")
    with pytest.raises(ValueError, match="stage 0 runs on ranks 0 and 1"):
        load_program(tmp_path / "split.csv")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="program JSON lacks .num_microbatches."):
        load_program(tmp_path / "bad.json")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[1]", "program JSON is a list"),
        ("{", "does not parse"),
        ('{"num_microbatches": "x"}', "'num_microbatches' must be an integer"),
        (
            '{"num_microbatches": 1, "rank_of_stage": [0], "actions": [[5]]}',
            "'actions' must be lists of strings",
        ),
        ('{"num_microbatches": 1, "rank_of_stage": [0]}', "lacks 'actions'"),
    ],
)
def test_malformed_json_names_the_field(text, message) -> None:
    with pytest.raises(ValueError, match=message):
        from_json(text)


def test_csv_blank_lines() -> None:
    assert from_csv("0F0,0B0\n\n\n").num_ranks == 1  # trailing blank lines are not ranks
    with pytest.raises(ValueError, match=r"line 1 \(rank 0\) holds no action"):
        from_csv("\n0F0,0B0\n")
