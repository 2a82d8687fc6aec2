"""The command line as a user meets it: outputs, JSON, files, and bad input (exit 2, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pipetrain.cli import main
from pipetrain.schedule.registry import FAMILIES, build_schedule


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
    code, out, _ = run(capsys, "schedules", "--width", "80")
    assert all(len(line) <= 80 for line in out.splitlines())


def test_show_prints_the_grid(capsys) -> None:
    code, out, _ = run(capsys, "show", "--schedule", "1f1b", "--ranks", "2", "--microbatches", "3")
    assert code == 0
    assert "rank 0" in out and "rank 1" in out and "1B2" in out
    code, out, _ = run(capsys, "show", "-s", "1f1b", "-p", "2", "-m", "3", "--lowered")
    assert "0SEND_F0" in out and "1RECV_F0" in out


def test_the_schedule_can_be_named_positionally(capsys) -> None:
    flag = run(capsys, "show", "--schedule", "zbv", "-p", "2", "-m", "4")
    positional = run(capsys, "show", "zbv", "-p", "2", "-m", "4")
    after = run(capsys, "show", "-p", "2", "-m", "4", "zbv")
    assert flag == positional == after and flag[0] == 0
    code, out, _ = run(capsys, "simulate", "zb-h1", "-p", "4", "-m", "8", "--json")
    assert code == 0 and json.loads(out)["schedule"] == "zb-h1"
    code, _, err = run(capsys, "show", "zbv", "-s", "1f1b", "-p", "2", "-m", "4")
    assert code == 2 and "given twice (zbv and 1f1b)" in err
    code, _, err = run(capsys, "show", "-p", "2", "-m", "4")
    assert code == 2 and "give the schedule" in err and "zbv" in err


@pytest.mark.parametrize("width", [60, 100, 140])
def test_show_fits_the_width_and_keeps_every_step(capsys, width: int) -> None:
    code, out, _ = run(capsys, "show", "zbv", "-p", "4", "-m", "8", "--width", str(width))
    assert code == 0
    assert all(len(line) <= width for line in out.splitlines()), out
    program = build_schedule("zbv", 4, 8)
    for row in program.actions:  # every action drawn, in order, across the bands
        drawn = [cell for line in out.splitlines() if line.startswith(f"rank {row[0].stage}")
                 for cell in line.split()[2:] if cell != "…"]  # fmt: skip
        assert drawn == [str(a) for a in row]
    headers = [line for line in out.splitlines() if line.startswith(" ")]
    assert [int(n) for line in headers for n in line.split()] == list(
        range(len(program.actions[0]))
    )


def test_show_windows_a_long_program(capsys) -> None:
    code, out, _ = run(capsys, "show", "1f1b", "-p", "4", "-m", "200", "--lowered", "--width", "80")
    assert code == 0
    assert "not shown; --save FILE writes the whole program" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    assert len(out.splitlines()) < 60


def test_shapes_read_in_the_singular_too(capsys) -> None:
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "1", "-m", "1", "--width", "60")
    assert code == 0
    assert out.splitlines()[0] == "1f1b: 1 rank, 1 stage per rank, 1 micro-batch"
    code, out, _ = run(capsys, "show", "1f1b", "-p", "1", "-m", "1")
    assert out.splitlines()[0].startswith("1f1b: 1 rank, 1 stage (")


def test_compare_says_what_its_units_are(capsys) -> None:
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "--width", "80")
    assert code == 0
    assert "per rank's share of the model" in " ".join(out.split()) and "1/v" in out
    assert all(len(line) <= 80 for line in out.splitlines()[:5])


def test_demo_draws_the_tables_zbv_row(capsys, tmp_path) -> None:
    code, out, _ = run(capsys, "demo", "--plan-only", "--out", str(tmp_path), "--width", "100")
    assert code == 0
    zbv_row = next(line for line in out.splitlines() if line.startswith("zbv "))
    makespan = zbv_row.split()[2]
    assert f"makespan {makespan}   span" in out  # the drawn step is the table's row
    assert "F0" in out and "f0" in out and "2nd chunk" in out  # blocks keep their labels
    assert (tmp_path / "zbv_simulated.svg").read_text().startswith("<svg")


BLOCK_TORCH = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Block())
import pipetrain.cli
sys.exit(pipetrain.cli.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("argv", [["train", "--steps", "1"], ["demo", "--out", "{tmp}"]])
def test_commands_that_need_torch_refuse_in_one_line_without_it(argv, tmp_path) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    done = subprocess.run(
        [sys.executable, "-c", BLOCK_TORCH, *argv], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("\n") == 1 and "pip install 'pipetrain[torch]'" in done.stderr
    assert done.stdout == ""


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
        (["simulate"], "give SCHEDULE (or --schedule NAME)"),
        (["simulate", "--program", "x.csv", "-p", "3"], "drop --ranks"),
        (["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "-F", "1e300"], "numbers in [0, 1e+15]"),
        (
            ["simulate", "-s", "1f1b", "-p", "2", "-m", "2", "--svg", "/no/dir/x.svg"],
            "cannot write",
        ),
        (["train", "-s", "dualpipe"], "planning only"),
        (["train", "--tp", "3"], "--tp 3 must divide --heads 4"),
        (["train", "--tp", "2", "--model", "gpt"], "Llama-family model"),
        (["train", "--sequence-parallel"], "--sequence-parallel needs --tp"),
        (
            ["train", "--tp", "2", "--dp", "2", "--data-parallel", "ddp"],
            "needs --data-parallel fsdp",
        ),
        (["train", "--tp", "2", "--device", "cuda"], "needs 4 GPUs"),
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


def test_train_flags_are_the_config_fields_and_round_trip_through_argv() -> None:
    """Each ``train`` flag is the ``TrainConfig`` field of its name (with its default), so the
    command line the launcher writes for its workers parses back into the same config."""
    import dataclasses

    from pipetrain.app.config import TrainConfig
    from pipetrain.cli.train_command import config_from_argv, options

    dests = {opt.dest for opt in options()} - {
        "schedule_positional",
        "config",
    }  # read into the rest
    assert dests == {f.name for f in dataclasses.fields(TrainConfig)}
    assert config_from_argv([]) == TrainConfig()
    given = ["zbv", "-p", "2", "--receive-lead", "none", "--lr", "0.01", "--resume"]
    config = config_from_argv([*given, "--checkpoint-dir", "ckpt", "--clip-grad-norm", "1"])
    assert config.receive_lead is None and config.schedule == "zbv"
    assert config_from_argv(config.argv()) == config


def test_a_config_refuses_what_its_flag_refuses() -> None:
    from pipetrain.app.config import TrainConfig

    with pytest.raises(ValueError, match="--device must be one of auto, cpu, cuda"):
        TrainConfig(device="tpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--steps must be > 0"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="--receive-lead must be none or an integer >= 0"):
        TrainConfig(receive_lead=-1)


def test_simulate_offload_marks_the_copies_and_refuses_bad_fractions(capsys) -> None:
    argv = ["simulate", "1f1b", "--ranks", "4", "--microbatches", "8", "--width", "80"]
    assert main([*argv, "--offload", "1", "--host-copy", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "v: an offload ends" in out and "peak activations per rank [3, 3, 2, 1]" in out
    assert main([*argv, "--offload", "1.5"]) == 2
    assert "offload fraction of stage 0 must be a number in [0, 1]" in capsys.readouterr().err
    assert main([*argv, "--offload", "0,0,0,1"]) == 2
    assert "nothing to offload there" in capsys.readouterr().err
    # layer by layer (4 layers per stage), reloads just in time: rank 0 of 1F1B on 2 ranks
    # holds what the last stage holds, one micro-batch, instead of two
    two = ["simulate", "1f1b", "--ranks", "2", "--microbatches", "8", "--offload", "1"]
    assert main([*two, "--host-copy", "0.3", "--stage-layers", "4"]) == 0
    assert "peak activations per rank [1, 1]" in capsys.readouterr().out
    assert main([*two, "--host-copy", "0.3"]) == 0  # in one piece it cannot help there
    assert "peak activations per rank [2, 1]" in capsys.readouterr().out
    assert main([*two, "--stage-layers", "0"]) == 2
    assert "cost layers is a whole number >= 1" in capsys.readouterr().err
