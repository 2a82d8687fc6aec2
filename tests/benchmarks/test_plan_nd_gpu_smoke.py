"""benchmarks/planner/plan_nd_gpu.py, the N-D plans and synthesized schedules measured on GPUs:
what it reports from launches (intervals, errors, regret, speed-up), which shapes it runs, how
it reads a launch back, and the float64 check of a synthesized program on 2 gloo processes (the
default tier: one short run of 2 processes). The end-to-end dry runs of both modes (cpu-smoke:
profile, plan or synthesize, float64 check, every run through ``pipetrain train --plan``) start
about ten processes that each import torch and transformers, too long for the default tier on 2
cores: the stress tier (make test-all)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.planner.plan_nd_gpu import nd_runs, same_layout
from benchmarks.planner.plan_nd_launch import read_launch
from benchmarks.planner.plan_nd_report import location_interval, summarize
from benchmarks.planner.plan_nd_synthesized import plan_json
from pipetrain.planner.costs_file import LayerCost, ModelCosts
from pipetrain.planner.costs_file_tp import TpShape, derive
from pipetrain.planner.layout import Layout
from pipetrain.planner.nd_search import Cluster, nd_search
from pipetrain.planner.synthesize import synthesize

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "planner" / "plan_nd_gpu.py"
EQUIVALENCE = ROOT / "benchmarks" / "planner" / "plan_program_equivalence.py"
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def _layer(name: str, f: float, params: float, head: bool = False) -> LayerCost:
    shape = TpShape(0.6 * f, 0.9, 0.5, 4e6, 4e6)
    base = dict(forward=f, backward_input=f, backward_weight=f, activation=0.2, params=params)
    tp = tuple(derive(t, **base, gradients=params / 4, shape=shape, link_gbs=50.0) for t in (2, 4))
    return LayerCost(name=name, backward=2 * f, gradients=params / 4, tp=tp, **base)


def _costs(blocks: int, seed: int = 0) -> ModelCosts:
    rng = random.Random(seed)
    layers = [_layer("embed", 0.1, 1.0)]
    layers += [_layer(f"b{i}", rng.uniform(0.5, 1.5), rng.uniform(0.2, 1)) for i in range(blocks)]
    layers += [_layer("norm", 0.05, 0.0), _layer("head", 3.0, 2.0)]
    return ModelCosts(layers=tuple(layers), comm=0.05, meta={"micro_batch_size": 2, "seq_len": 8})


def test_location_interval_brackets_the_mean_of_launch_medians() -> None:
    rng = random.Random(1)
    launches = [[10 + k + rng.gauss(0, 0.3) for _ in range(20)] for k in range(3)]
    iv = location_interval(launches)
    assert iv is not None
    medians = sorted(sorted(x)[10] / 2 + sorted(x)[9] / 2 for x in launches)
    assert iv.estimate == pytest.approx(sum(medians) / 3)
    # launches 1 ms apart with 0.3 ms step noise: the launch level dominates the interval
    assert min(map(min, launches)) <= iv.low < iv.estimate < iv.high <= max(map(max, launches))
    assert iv.high - iv.low > 0.5
    assert (iv.launches, iv.steps) == (3, 20)
    # noise-free steps give a point; no timed step gives nothing
    flat = location_interval([[5.0] * 4, [5.0] * 4])
    assert flat is not None and flat.low == flat.high == 5.0
    assert location_interval([[], []]) is None


def _launches(step_ms: float, spread: float = 0.01, launches: int = 3) -> list[dict]:
    rng = random.Random(int(step_ms * 1000))
    return [
        {
            "steps_ms": [step_ms * (1 + rng.uniform(-spread, spread)) for _ in range(20)],
            "pipeline_ms": step_ms * 0.9,
        }
        for _ in range(launches)
    ]


def _run(name: str, predicted: float, count: int) -> dict:
    return {
        "name": name,
        "predicted_step_ms": predicted,
        "predicted_pipeline_ms": predicted,
        "global_microbatches": count,
        "plan_file": "-",
    }


def test_nd_report_prices_errors_and_the_picks_regret_per_global_microbatch() -> None:
    # the pick runs 8 global micro-batches in 100 ms (12.5 a micro-batch); the other shape 16 in
    # 180 ms (11.25): the pick is 11.1% behind, per global micro-batch, not per step
    runs = [_run("pick", 90.0, 8), _run("other", 200.0, 16)]
    launches = {"pick": _launches(100.0), "other": _launches(180.0)}
    report = summarize("nd", runs, launches, {})
    pick, other = report["runs"]
    assert pick["step_error"] == pytest.approx(90 / pick["measured_step_ms"]["estimate"] - 1)
    assert pick["step_error"] < 0 < other["step_error"]
    assert pick["pipeline_error"] == pytest.approx(90 / pick["measured_pipeline_ms"] - 1)
    assert report["best_measured"] == "other"
    per = [r["measured_step_ms"]["estimate"] / r["global_microbatches"] for r in (pick, other)]
    assert report["regret"] == pytest.approx(per[0] / per[1] - 1)
    assert report["regret"] == pytest.approx((100 / 8) / (180 / 16) - 1, abs=0.025)
    iv = report["regret_interval"]
    assert iv["low"] - 1 > 0.03 and report["regret_verdict"] == "missed"
    # the pick measured fastest: no regret, met
    fast = summarize("nd", runs, {"pick": _launches(80.0), "other": _launches(180.0)}, {})
    assert fast["regret"] == 0 and fast["regret_verdict"].startswith("met")


def test_a_failed_launch_is_reported_not_averaged() -> None:
    runs = [_run("synthesized", 50.0, 4), _run("planner", 60.0, 4)]
    failed = [{"error": "exit 1: boom"}, *_launches(55.0, launches=2)]
    report = summarize("synthesized", runs, {"synthesized": failed, "planner": _launches(66.0)}, {})
    synth = report["runs"][0]
    assert synth["errors"] == ["exit 1: boom"] and synth["measured_step_ms"]["launches"] == 2
    # the speed-up pairs the launches both runs measured (the failed one dropped)
    assert report["speedup"]["launches"] == 2
    assert report["speedup"]["estimate"] == pytest.approx(66 / 55, rel=0.02)
    assert report["predicted_speedup"] == pytest.approx(60 / 50)


def test_nd_runs_are_the_pick_and_every_shape_within_near(tmp_path: Path) -> None:
    costs = _costs(6)
    cluster = Cluster(gpus=8, gpus_per_node=8, link_gbs=50.0, node_link_gbs=25.0)
    found = nd_search(
        costs, cluster, memory_gib=100.0, global_batch=32, micro_batch_size=2, exhaustive=True
    )
    ranked = found.ranked
    pick = ranked[0].ms_per_global_microbatch
    near = (ranked[2].ms_per_global_microbatch / pick - 1) * 1.0001  # the three fastest shapes
    runs = nd_runs(ranked, near, tmp_path)
    inside = [nd for nd in ranked if nd.ms_per_global_microbatch <= pick * (1 + near)]
    assert len(runs) == len(inside) >= 3 and runs[0]["name"].startswith("pick: ")
    assert [tuple(r["shape"]) for r in runs] == [
        (n.shape.pp, n.shape.tp, n.shape.dp) for n in inside
    ]
    for run, nd in zip(runs, inside):
        plan = json.loads(Path(run["plan_file"]).read_text())
        layout = Layout.from_json(plan)
        assert (layout.ranks, layout.tp, layout.dp) == tuple(run["shape"])
        assert run["global_microbatches"] * 2 == 32  # the same tokens a step, every shape
        assert run["predicted_step_ms"] == nd.step_ms >= run["predicted_pipeline_ms"]
        assert same_layout(plan, nd.to_json())
        assert run["within_near"]
    # nothing within 0%: the runner-up shape is run all the same, said to be beyond
    alone = nd_runs(ranked, 0.0, tmp_path)
    assert [r["within_near"] for r in alone] == [True, False]
    assert alone[1]["shape"] == [ranked[1].shape.pp, ranked[1].shape.tp, ranked[1].shape.dp]


def test_a_launch_is_read_from_its_metrics_and_its_report(tmp_path: Path) -> None:
    metrics, log = tmp_path / "metrics.jsonl", tmp_path / "train.log"
    records = [{"step": s, "tokens": 256, "tok_per_s": 256 / (0.01 * s)} for s in range(1, 7)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records))
    log.write_text(
        "loss ...\nmeasured step:   makespan    17.16 ms   bubble  45.0%   (the median of the "
        "last 2 steps)\n"
    )
    got = read_launch(metrics, log, warmup=1)
    # step 1 warms up; steps 5 and 6 recorded a timeline: the timed ones are 2 to 4
    assert got["steps_ms"] == pytest.approx([20.0, 30.0, 40.0])
    assert got["pipeline_ms"] == 17.16
    assert "error" in read_launch(metrics, log, warmup=4)


def _synthesized_plan(tmp_path: Path, blocks: int) -> Path:
    costs = _costs(blocks, seed=3)
    result = synthesize(costs, num_ranks=2, num_microbatches=4, memory_gib=100.0)
    path = tmp_path / "synthesized.json"
    path.write_text(json.dumps(plan_json(result)))
    return path


#: the benchmark's own float64 worker (a torchrun of 2 processes, ~10 s on 2 cores); the runtime's
#: exactness on synthesized programs is tested in the default tier (tests/runtime/test_synthesized_runs.py)
@pytest.mark.stress
@pytest.mark.slow
def test_a_synthesized_program_runs_exactly_in_float64_on_two_gloo_processes(
    tmp_path: Path,
) -> None:
    plan = _synthesized_plan(tmp_path, blocks=3)
    assert json.loads(plan.read_text())["program"]["actions"]  # the program itself travels
    out = tmp_path / "equivalence.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(EQUIVALENCE),
        "--plan",
        str(plan),
        "--blocks",
        "3",
        "--tie-embeddings",
        "--device",
        "cpu",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["missing"] == [] and result["parameters"] > 20
    assert result["loss_rel_err"] <= 1e-12 and result["grad_rel_err"] <= 1e-12


@pytest.mark.stress
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["synthesized", "nd"])
def test_cpu_smoke_runs_every_step_of_the_mode(tmp_path: Path, mode: str) -> None:
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--mode",
        mode,
        "--preset",
        "cpu-smoke",
        "--out",
        str(tmp_path),
    ]
    if mode == "nd":  # a call cut short by --budget-s (profiled, planned, nothing run), resumed
        done = subprocess.run(
            [*cmd, "--budget-s", "0"],
            capture_output=True,
            text=True,
            timeout=600,
            env=ENV,
            cwd=ROOT,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        cut = json.loads((tmp_path / "report.json").read_text())
        assert "--budget-s 0 reached" in cut["meta"]["stopped"]
        assert all("measured_step_ms" not in r for r in cut["runs"])
        cmd.append("--resume")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    folder = tmp_path / "case1" if mode == "synthesized" else tmp_path
    report = json.loads((folder / "report.json").read_text())
    for run in report["runs"]:
        assert run["errors"] == [], run["errors"]
        m = run["measured_step_ms"]
        assert m["launches"] == 1 and m["steps"] == 2 and m["low"] <= m["estimate"] <= m["high"]
        assert run["measured_pipeline_ms"] > 0  # the run report's measured step was read
        assert Layout.from_json(json.loads(Path(run["plan_file"]).read_text()))
    summary = (folder / "summary.txt").read_text()
    assert "measured ms [95%]" in summary and report["command"] in summary
    if mode == "synthesized":
        assert report["equivalence"]["ok"] and report["equivalence"]["backend"] == "gloo"
        assert report["runs"][0]["name"] == "synthesized"
        assert "speedup" in report and report["budgets"]
    else:
        shapes = {tuple(r["shape"]) for r in report["runs"]}
        assert (1, 2, 1) in shapes and (1, 1, 2) in shapes  # tensor and data parallel both ran
        assert report["cli_pick_agrees"] and report["tp"]["derived"] == [2]
        assert report["regret"] >= 0 and report["regret_verdict"]
