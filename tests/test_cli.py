"""The command line as a user meets it: outputs, JSON, files, and bad input (exit 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipetrain.cli import main
from pipetrain.schedule.registry import FAMILIES


def run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse exits on its own errors
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_schedules_lists_every_family(capsys) -> None:
    code, out, _ = run(capsys, "schedules")
    assert code == 0
    for name in (
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
        "looped-bfs",
        "zb-h1",
        "zb-h2",
        "interleaved-zb",
        "zbv",
        "dualpipev",
    ):
        assert name in out
    assert out.count("constraints:") == len(FAMILIES)


def test_show_prints_the_grid(capsys) -> None:
    code, out, _ = run(capsys, "show", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "3")
    assert code == 0
    assert "rank 0" in out and "rank 1" in out and "1B2" in out
    code, out, _ = run(capsys, "show", "-s", "1f1b", "-p", "2", "-m", "3", "--lowered")
    assert "0SEND_F0" in out and "1RECV_F0" in out


def test_simulate_json_has_the_documented_fields(capsys) -> None:
    code, out, _ = run(capsys, "simulate", "-s", "zb-h2", "-p", "4", "-m", "8", "--json")
    assert code == 0
    data = json.loads(out)
    for key in (
        "schedule",
        "ranks",
        "stages",
        "microbatches",
        "makespan",
        "span",
        "bubble_fraction",
        "per_rank",
    ):
        assert key in data
    assert data["makespan"] == 27 and data["span"] == 24
    assert [r["peak_activations"] for r in data["per_rank"]] == [7, 7, 7, 7]
    assert set(data["per_rank"][0]) >= {"rank", "busy", "idle", "span", "peak_activations"}


def test_simulate_per_stage_costs_and_pictures(capsys, tmp_path) -> None:
    svg, trace = tmp_path / "t.svg", tmp_path / "t.json"
    code, out, _ = run(
        capsys, "simulate", "-s", "zbv", "-p", "2", "-m", "4", "-F", "1,2,2,1", "-C", "0.1",
        "--svg", str(svg), "--trace", str(trace),
    )  # fmt: skip
    assert code == 0
    assert "makespan" in out and "rank 1" in out
    assert svg.read_text().startswith("<svg") or "<svg" in svg.read_text()[:200]
    assert json.loads(trace.read_text())["traceEvents"]


def test_simulate_a_program_file_round_trip(capsys, tmp_path) -> None:
    path = tmp_path / "p.csv"
    run(capsys, "show", "-s", "interleaved-1f1b", "-p", "2", "-m", "4", "--save", str(path))
    code, out, _ = run(capsys, "simulate", "--program", str(path), "--json")
    assert code == 0
    assert json.loads(out)["stages"] == 4


def test_compare_ranks_every_applicable_family(capsys) -> None:
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "6")
    assert code == 0
    assert "not applicable: dualpipev" in out  # needs m >= 2p
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "--json")
    rows = json.loads(out)
    assert len(rows) == len(FAMILIES)
    assert [r["makespan"] for r in rows] == sorted(r["makespan"] for r in rows)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "-s", "nope", "-p", "2", "-m", "2"], "legal schedules: gpipe"),
        (["simulate", "-s", "1f1b", "-p", "0", "-m", "2"], "expected an integer >= 1"),
        (["simulate", "-s", "1f1b", "-p", "2", "-m", "-3"], "expected an integer >= 1"),
        (["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "-F", "-1"], "numbers in [0, 1e+15]"),
        (["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "-W", "inf"], "numbers in [0, 1e+15]"),
        (
            ["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "-F", "1,2,3"],
            "one number or one per stage",
        ),
        (
            ["simulate", "-s", "dualpipev", "-p", "4", "-m", "3"],
            "num_microbatches >= 2 x num_ranks",
        ),
        (
            ["simulate", "-s", "zbv", "-p", "2", "-m", "4", "-v", "3"],
            "zbv needs stages_per_rank = 2, got 3",
        ),
        (
            ["simulate", "-s", "interleaved-1f1b", "-p", "4", "-m", "6", "--group-size", "5"],
            "microbatch_group_size in",
        ),
        (["simulate", "--program", "/no/such/file.csv"], "cannot read program file"),
        (["simulate"], "give --schedule NAME"),
        (["simulate", "--program", "x.csv", "-p", "3"], "drop --ranks"),
        (["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "-F", "1e300"], "numbers in [0, 1e+15]"),
        (
            ["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--svg", "/no/dir/x.svg"],
            "cannot write",
        ),
        (["train", "-s", "dualpipe"], "planning only"),
        (
            ["show", "-s", "gpipe", "-p", "2", "-m", "2", "-v", "2"],
            "gpipe needs stages_per_rank = 1, got 2",
        ),
    ],
)
def test_bad_input_exits_2_with_a_message(capsys, argv, message) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_deadlocking_program_file(capsys, tmp_path) -> None:
    path = tmp_path / "dead.csv"
    path.write_text("0F1,0B0,0F0,0B1\n1F0,1B0,1F1,1B1\n")
    code, _, err = run(capsys, "simulate", "--program", str(path))
    assert code == 2
    assert "deadlock" in err and "waits for" in err and ">0B0<" in err


def test_module_entry_point_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pipetrain", "simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["makespan"] == 9
