"""benchmarks/incumbents/incumbents_call.py's plans and runner: the rotated launch series (three
launches numbered from 0 by default, ``LAUNCHES`` and ``FIRST_LAUNCH`` to run more or to continue
a series in a later call; each launch's number rotates the libraries' order and names its part),
the rows a plan runs, the budgets cut to the time left, and a step stopped by its timeout."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks.common.call_steps import run_logged
from benchmarks.incumbents.incumbents_call import command, fitted
from benchmarks.incumbents.incumbents_call_plans import PLANS, Part, Settings, launches, plan


def _parts(**env: str) -> list[str]:
    """The parts ``launches`` makes, each as the shell version printed them."""
    settings = Settings.from_env(env, "/w")
    return [
        f"{p.name} {p.nproc} {p.budget_s} {p.limit_s} {' '.join(p.args)}"
        for p in launches(settings, "e", "gpt16", 2, 110, 145, ["--more"])
    ]


def test_three_launches_from_zero_by_default() -> None:
    assert _parts() == [
        "e1-gpt16-l0 2 110 145 --launch 0 --more",
        "e2-gpt16-l1 2 110 145 --launch 1 --more",
        "e3-gpt16-l2 2 110 145 --launch 2 --more",
    ]


def test_a_later_call_continues_the_series() -> None:
    assert _parts(LAUNCHES="2", FIRST_LAUNCH="3") == [
        "e4-gpt16-l3 2 110 145 --launch 3 --more",
        "e5-gpt16-l4 2 110 145 --launch 4 --more",
    ]


def test_issue21_runs_the_gpt_three_times_then_the_llama_shape() -> None:
    parts = plan("issue21", Settings.from_env({"GPT": "gpt-tiny", "STEPS": "3"}, "/w"))
    assert [(p.name, p.nproc, p.budget_s, p.limit_s) for p in parts] == [
        ("i1-gpt16-l0", 2, 170, 210),
        ("i2-gpt16-l1", 2, 75, 110),
        ("i3-gpt16-l2", 2, 75, 110),
        ("i4-llama8-l0", 2, 125, 165),
    ]
    first, second = parts[0].args, parts[1].args
    assert first[:4] == ("--launch", "0", "--shapes", "gpt-tiny")
    assert first[-2:] == ("--libraries", "megatron-nosync,megatron-sweep,megatron-gaf")
    assert ("--steps", "3") in itertools.pairwise(first)
    # later launches pick Megatron's fastest variants from launch 0's results in this call
    assert second[-2:] == ("--megatron-tuned-from", "/w/i1-gpt16-l0/incumbents.json")
    tuned = plan("issue21", Settings.from_env({"TUNED": "/old/l0.json"}, "/w"))[1].args
    assert tuned[-1] == "/old/l0.json"


def test_plans_that_need_an_earlier_launch_zero_refuse_to_start_without_one() -> None:
    for name in ("issue21-best2", "issue21-equal", "issue21x4-mgraph", "issue21x4g"):
        with pytest.raises(ValueError, match="TUNED"):
            plan(name, Settings())
    with pytest.raises(ValueError, match="PLAN='nope': one of issue21, "):
        plan("nope", Settings())


def test_every_plan_names_its_parts_once() -> None:
    settings = Settings(tuned="/t.json")
    for name in PLANS:
        names = [p.name for p in plan(name, settings)]
        assert names and len(names) == len(set(names)), name


def test_the_old_default_plan_leaves_the_two_rank_wide_part_to_four_gpus() -> None:
    four = plan("issue13", Settings())
    assert [p.name for p in four] == [
        "p1-wide4",
        "p2-prof4",
        "p2e-exact4",
        "p3-blocks2",
        "p4-wide2",
    ]
    assert four[2].exact and (four[-1].budget_s, four[-1].limit_s) == (None, None)
    assert [p.name for p in plan("issue13", Settings(nproc4=2))][-1] == "p3-blocks2"


def test_a_part_is_cut_to_the_time_left() -> None:
    part = Part("x", 2, 170, 210)
    assert fitted(part, 500) == (170, 210)
    assert fitted(part, 100) == (70, 100)  # the timeout keeps 30 s beyond the budget
    assert fitted(Part("rest", 2, None, None), 300) == (270, 300)


def test_a_step_is_stopped_by_its_timeout_and_logged(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "step.log"
    started = time.monotonic()
    rc = run_logged(["sh", "-c", "echo started; sleep 30"], 1, log, kill_after_s=1)
    assert rc == 124 and time.monotonic() - started < 10
    assert log.read_text() == "started\n"


def test_a_part_launches_the_harness_with_its_budget() -> None:
    class Call:
        python, work, env = "py", Path("/w"), {"PREHEAT": "20"}

    argv = command(Call(), Part("p", 4, 170, 210, ("--launch", "1")), 150)  # type: ignore[arg-type]
    assert argv[:6] == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
    ]
    assert argv[6:] == [
        "benchmarks/incumbents/incumbents.py",
        "--out",
        "/w/p",
        "--budget-s",
        "150",
        "--preheat-s",
        "20",
        "--launch",
        "1",
    ]
