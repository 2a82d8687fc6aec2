"""benchmarks/incumbents/incumbents_stats.py and the harness's row plumbing: pooled launches give each
ratio its interval and read verdicts off the interval's far end; Megatron's variant names, its
sweep and the cuts are what docs/incumbents.md says they are."""

from __future__ import annotations

import itertools
import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.incumbents.incumbents_stats import report

#: per (schedule, lib): the median step (ms) the synthetic launches scatter around
ROWS = {
    ("1f1b", "pipetrain"): 96.0,
    ("1f1b", "pipetrain-nodefer"): 100.0,
    ("1f1b", "megatron-nosync"): 100.0,
    ("interleaved-1f1b", "pipetrain"): 90.0,
    ("interleaved-1f1b", "megatron-v2"): 95.0,
    ("interleaved-1f1b", "megatron-v4-wf"): 94.0,
    ("zbv", "pipetrain"): 85.0,
}


def launch(k: int, rng: random.Random) -> dict:
    rows = []
    for (schedule, lib), ms in ROWS.items():
        steps = [ms * (1 + rng.gauss(0, 0.003)) for _ in range(20)]
        row = {"shape": "gpt", "microbatches": 16, "schedule": schedule, "lib": lib, "v": 2}
        row |= {"all_ms": steps, "median_ms": sorted(steps)[10], "peak_total_gib": [2.0, 1.0]}
        if (schedule, lib) == ("zbv", "pipetrain"):
            row["limit_key"] = "gpt/v/2/16/9-4-4-9"
        if lib == "megatron-nosync":
            row["peak_total_gib"] = [1.9, 1.0]  # pipetrain's rank 0 is 0.1 GiB above
        if (schedule, lib, k) == ("1f1b", "pipetrain", 2):
            row["peak_total_gib"] = [2.5, 1.0]  # ran first in the last launch (median: 2.0)
        rows.append(row)
    rows.append({"shape": "gpt", "microbatches": 16, "schedule": "1f1b", "lib": "megatron-gaf"})
    rows[-1]["skipped"] = "gradient_accumulation_fusion: needs apex"
    limit = {"all_ms": [84.15 * (1 + rng.gauss(0, 0.003)) for _ in range(20)]}
    meta = {"device": "test GPU", "world": 2, "launch": k, "versions": {"torch": "x"}}
    return {"meta": meta, "rows": rows, "limits": {"gpt/v/2/16/9-4-4-9": limit}}


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("launches")
    rng = random.Random(3)
    paths = []
    for k in range(3):
        p = folder / f"l{k}.json"
        p.write_text(json.dumps(launch(k, rng)))
        paths.append(p)
    return report(paths)


def line(out: str, *needles: str) -> str:
    return next(x for x in out.splitlines() if all(n in x for n in needles))


def test_ratios_come_with_intervals_and_far_end_verdicts(out: str) -> None:
    ratio = line(out, "pipetrain 1f1b / megatron-nosync (defaults)")
    assert "0.96" in ratio and ratio.endswith("target ≤ 1.0: met")
    equal = line(out, "pipetrain-nodefer 1f1b / megatron-nosync (equal kernels)")
    assert "1.00" in equal and "target ≤ 1.01" in equal
    fused = line(out, "1f1b: what the fused weight-gradient accumulation gives")
    assert "0.96" in fused
    # Megatron's same-schedule reference is its fastest interleaved variant
    assert "pipetrain interleaved-1f1b / megatron-v4-wf" in out
    best = line(out, "pipetrain's best (pipetrain zbv) / Megatron's best (megatron-v4-wf")
    assert "0.90" in best and best.endswith("met")
    # the best row's cut without a pipeline: the bound no schedule of that cut goes below
    bound = line(out, "its cut's no-pipeline limit (eager) / Megatron's best")
    assert "0.89" in bound


def test_efficiency_noise_floor_and_memory(out: str) -> None:
    eff = line(out, "zbv efficiency")
    assert "0.99" in eff and eff.endswith("target ≥ 0.97: met")
    assert "noise floor: a pipetrain row against itself" in out
    assert line(out, "1f1b peak allocated memory").endswith("megatron-nosync (+0.100 GiB)")
    assert "| 3 × 20 |" in line(out, "| 1f1b | pipetrain |")
    assert "needs apex" in line(out, "| megatron-gaf |")


def test_megatron_variants_and_sweep() -> None:
    from benchmarks.incumbents.incumbents_megatron import Variant, name, parse, sweep

    assert parse("megatron-nosync") == Variant(sync=False)
    assert parse("megatron-v4-g4-wf") == Variant(v=4, group=4, warmup_flush=True)
    assert parse(name(8, 2, False, ranks=2)) == Variant(v=8)  # group p is the default
    # any row as Megatron's own full-iteration CUDA graph
    assert parse("megatron-nosync-graph") == Variant(sync=False, graph=True)
    assert parse("megatron-v2-g4-wf-graph") == Variant(v=2, group=4, warmup_flush=True, graph=True)
    with pytest.raises(ValueError, match="unknown Megatron row"):
        parse("megatron-graph-v2")
    rows = sweep([2, 4, 8], 16, 2)
    assert len(rows) == 12 and "megatron-v8-g4-wf" in rows
    # 8 micro-batches on 4 ranks: groups of 4 and 8; 6 on 4 ranks: a last group of 2 < p
    g4, g8 = ["megatron-v2", "megatron-v2-wf"], ["megatron-v2-g8", "megatron-v2-g8-wf"]
    assert sweep([2], 8, 4) == g4 + g8
    assert sweep([2], 6, 4) == []


def test_cuts() -> None:
    from benchmarks.incumbents.incumbents_shapes import (
        SHAPES,
        analytic_costs,
        incumbent_cut,
        interleave_options,
        planner_cut,
        uniform_cut,
    )

    gpt, llama = SHAPES["gpt"], SHAPES["llama"]
    assert interleave_options(gpt, 2) == [2, 4, 8] and interleave_options(gpt, 4) == [2, 4]
    assert interleave_options(llama, 2) == [5] and interleave_options(SHAPES["llama-x4"], 4) == [3]
    assert uniform_cut(gpt, 4) == (5, 4, 4, 5)  # embedding and head ride on the end stages
    assert incumbent_cut(llama, 2) == (5, 5)  # Megatron's account-for-embedding/loss rule
    cut = planner_cut(analytic_costs(llama), "1f1b", 2, 1, 8, 80.0)
    assert sum(cut) == 10 and cut[0] > cut[1]  # the head's stage gets fewer blocks


def test_launches_of_different_collector_policies_are_not_pooled(tmp_path) -> None:
    rng, paths = random.Random(5), []
    for k, gc in enumerate(("python", "manual", "manual")):
        data = launch(k, rng)
        data["meta"]["gc"] = gc
        for row in data["rows"]:  # each step's collector pauses: one 30 ms pause with it on
            if "all_ms" in row:
                row["gc_pause_ms"] = [0.0] * 20
        if gc == "python":
            data["rows"][0]["gc_pause_ms"][7] = 30.0
        p = tmp_path / f"l{k}.json"
        p.write_text(json.dumps(data))
        paths.append(p)
    out = report(paths)
    assert "gc python, 1 file(s)" in out and "gc manual, 2 file(s)" in out
    python_part, manual_part = out.split("gc manual")
    assert "| 1 × 20 |" in line(python_part, "| 1f1b | pipetrain |")
    assert "| 2 × 20 |" in line(manual_part, "| 1f1b | pipetrain |")
    pauses = line(python_part, "collector pauses over 1 ms")
    assert "pipetrain 1f1b: 30 ms over 1 of 20 steps" in pauses
    assert line(manual_part, "collector pauses over 1 ms").endswith(": none")


def test_the_sweep_without_warmup_flush_overlap() -> None:
    from types import SimpleNamespace

    from benchmarks.incumbents.incumbents_plan import Plan
    from benchmarks.incumbents.incumbents_shapes import SHAPES

    args = SimpleNamespace(libraries="megatron-sweep-nowf", megatron_tuned_from="", megatron_top=2)
    plan = Plan(SimpleNamespace(world=4, args=args), bank=None)
    rows = plan.megatron_interleaved(SHAPES["gpt"], 16)
    assert rows and not any(r.endswith("-wf") for r in rows)
    assert "megatron-v4-g8" in rows


def test_a_ratio_whose_rows_ran_in_one_order_in_every_launch_says_so(tmp_path) -> None:
    # the first row of a launch measured up to 2% faster: a ratio over launches that all ran
    # pipetrain-nodefer first leans its way, and the report says so; a rotated order says nothing
    def files(places: list[dict[str, int]]) -> list[Path]:
        rng, paths = random.Random(5), []
        for k, place in enumerate(places):
            data = launch(k, rng)
            for row in data["rows"]:
                row["order"] = place.get(row["lib"], 9)
            p = tmp_path / f"o{len(places)}-{places[0]['megatron-nosync']}-{k}.json"
            p.write_text(json.dumps(data))
            paths.append(p)
        return paths

    first = {"pipetrain-nodefer": 0, "megatron-nosync": 1}
    one_sided = report(files([first, first]))
    equal = line(one_sided, "pipetrain-nodefer 1f1b / megatron-nosync (equal kernels)")
    assert equal.endswith(
        "(order one-sided: pipetrain-nodefer ran before megatron-nosync in all 2 paired launches)"
    )
    rotated = report(files([first, {"pipetrain-nodefer": 1, "megatron-nosync": 0}]))
    assert "one-sided" not in line(rotated, "pipetrain-nodefer 1f1b / megatron-nosync")


def test_every_two_launches_run_every_pair_of_rows_both_ways() -> None:
    from benchmarks.incumbents.incumbents_plan import launch_order

    rows = list("abcdef")
    for index in range(3):
        for first in (0, 2, 4):
            runs = [launch_order(rows, launch, index) for launch in (first, first + 1)]
            assert all(sorted(r) == rows for r in runs)
            for x, y in itertools.combinations(rows, 2):
                assert {r.index(x) < r.index(y) for r in runs} == {True, False}, (x, y, runs)
    # and a different row first from one pair of launches to the next
    assert len({launch_order(rows, launch, 0)[0] for launch in (0, 2, 4)}) == 3
