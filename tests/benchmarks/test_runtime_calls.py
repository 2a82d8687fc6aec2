"""The runtime folder's device-call plans: compile_float8_call.py rotates the variants' order per
launch (no variant always compiles first) and runs both parts per launch; cuda_graph_x4_call.py
runs its probes before the exactness and speed runs, each with its own timeout."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks.runtime.compile_float8_call import parts, plan, rotated
from benchmarks.runtime.cuda_graph_x4_call import STEPS


def test_each_launch_starts_the_variants_one_further_on() -> None:
    assert [rotated(k) for k in range(4)] == [
        ("eager", "compile", "compile+float8"),
        ("compile", "compile+float8", "eager"),
        ("compile+float8", "eager", "compile"),
        ("eager", "compile", "compile+float8"),
    ]
    assert [(x.preset, x.launch) for x in plan("h2048,h4096", 2)] == [
        ("h2048", 0),
        ("h2048", 1),
        ("h4096", 0),
        ("h4096", 1),
    ]


def test_a_launch_runs_the_unsplit_part_alone_then_the_pipeline_with_the_suffix() -> None:
    env = {"OUT": "/o", "SUFFIX": "/precompile", "LIMIT": "100"}
    (first, unsplit, alone), (second, pipeline, _) = parts(plan("h2048", 2)[1], env, "py")
    assert (first, second, alone) == ("unsplit", "pipeline", {"CUDA_VISIBLE_DEVICES": "0"})
    assert unsplit[-2:] == ["--variants", "compile,compile+float8,eager"]
    assert pipeline[-2:] == [
        "--variants",
        "compile/precompile,compile+float8/precompile,eager/precompile",
    ]
    assert "--stall-dump-s" in unsplit and unsplit[unsplit.index("--stall-dump-s") + 1] == "80"


def test_the_four_gpu_call_probes_first_and_names_each_run_once() -> None:
    names = [s.name for s in STEPS]
    assert names[0] == "probe4" and names[-1] == "speed4" and len(set(names)) == len(names)
    for step in STEPS:
        stacks = int(step.args[step.args.index("--stacks-after") + 1])
        assert stacks < step.limit_s  # every rank dumps its stacks before the timeout
