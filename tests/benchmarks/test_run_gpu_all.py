"""benchmarks/pipeline/run_gpu_all.py's plan: equivalence, split backward and the benchmark in
that order, each with its timeout and log, enough micro-batches for DualPipeV on every rank
count, and a summary that shows each table or, failing that, the log's tail."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*

from benchmarks.pipeline.run_gpu_all import sections, summarise


def test_the_plan_runs_three_sections_in_order_with_their_limits() -> None:
    plan = sections({"NPROC": "4", "EQ_ARGS": "--schedules 'zbv dualpipev'"}, "/o", "py")
    assert [(s.name, s.limit_s, s.log) for s in plan] == [
        ("equivalence", 80, "equivalence.log"),
        ("split-backward", 60, "split_backward.log"),
        ("pipeline", 300, "pipeline.log"),
    ]
    equivalence, split, bench = (list(s.argv) for s in plan)
    assert equivalence[-4:] == ["--microbatches", "8", "--schedules", "zbv dualpipev"]
    assert split == ["py", "benchmarks/runtime/split_backward_gpu.py", "--out", "/o"]
    assert bench[:6] == [
        "py",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "4",
    ]
    assert bench[-2:] == ["--budget-s", "235"]  # stops starting configurations 65 s early


def test_dualpipev_gets_two_micro_batches_a_rank() -> None:
    equivalence = sections({"NPROC": "8", "BENCH_S": "200"}, "/o", "py")[0].argv
    assert equivalence[-2:] == ("--microbatches", "16")
    assert sections({"BENCH_S": "200"}, "/o", "py")[2].argv[-1] == "135"


def test_the_summary_shows_the_table_or_the_tail(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("noise\n## equivalence\n[W warn] x\n| a | b |\n")
    assert summarise(log, "## equivalence") == "## equivalence\n| a | b |"
    log.write_text("".join(f"line {i}\n" for i in range(40)))
    shown = summarise(log, "## equivalence").splitlines()
    assert shown[0].startswith("(no table in") and shown[1:] == [f"line {i}" for i in range(15, 40)]
