"""Re-predict the peak memory of a saved ``gpu_pipeline.json`` with today's memory model.

    python benchmarks/pipeline/memory_model_check.py docs/results/h100x4-2026-11-26-run3/p4/gpu_pipeline.json [...]

For every pipetrain row (and variant row) the program is rebuilt from its name, rank count
and micro-batch count, simulated from the row's measured mean action times, and the peak memory
per rank predicted as ``gpu_pipeline.py`` does now (``gpu_memory.predicted_peaks``): activations
alone, and with each stage's measured workspace on the simulated timeline. Prints the largest gap
per row (measured / predicted − 1, worst rank) — no GPU needed, so a memory-model change can be
checked against every saved run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.pipeline.gpu_memory import parse_means, predicted_peaks
from benchmarks.pipeline.gpu_report import REPLAY
from pipetrain.schedule.lower import lower
from pipetrain.schedule.registry import build_schedule, family
from pipetrain.schedule.validate import validate


def worst_gap(measured: list[float], predicted: list[float]) -> float:
    """The rank where measured / predicted − 1 is largest in size, signed."""
    return max((m / p - 1 for m, p in zip(measured, predicted)), key=abs)


def check(path: Path) -> list[str]:
    data = json.loads(path.read_text())
    world, comm = data["meta"]["world"], data["meta"].get("comm_ms_one_way") or 0.0
    limits = {(v["layout"], v["stages_per_rank"], v["microbatches"]): v for v in data["limits"]}
    lines = []
    for row in data["rows"]:
        name, n = row["schedule"], row["microbatches"]
        v = family(name).default_stages_per_rank
        for lib, res in row.items():
            if not (lib.startswith("pipetrain") and isinstance(res, dict)):
                continue
            if "mean_action_ms" not in res or not res.get("peak_gib"):
                continue
            limit = next(
                (lim for key, lim in limits.items() if key[1:] == (v, n) and "median_ms" in lim),
                None,
            )
            if limit is None:
                continue
            program = validate(lower(build_schedule(name, world, n, stages_per_rank=v)))
            pred = predicted_peaks(
                program,
                parse_means(res["mean_action_ms"]),
                res["resident_gib"],
                limit,
                comm,
                replay=lib == REPLAY,
            )
            if not pred:
                continue
            peak = res["peak_gib"]
            lines.append(
                f"| {path} | {name} | {n} | {lib} | "
                f"{'/'.join(f'{x:.2f}' for x in peak)} | "
                f"{'/'.join(f'{x:.2f}' for x in pred['pred_peak_gib'])} | "
                f"{worst_gap(peak, pred['pred_peak_gib']):+.1%} | "
                f"{'/'.join(f'{x:.2f}' for x in pred['pred_peak_gib_with_workspace'])} | "
                f"{worst_gap(peak, pred['pred_peak_gib_with_workspace']):+.1%} |"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path, help="gpu_pipeline.json files")
    a = p.parse_args(argv)
    print(
        "| run | schedule | mb | lib | peak GiB | pred GiB (activations) | gap | "
        "pred GiB (+ workspace) | gap |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path in a.files:
        for line in check(path):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
