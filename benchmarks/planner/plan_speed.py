"""How long the planner takes on a large shape: 64 ranks, 128 layers (a Llama-like stack with a
heavy embedding and head), every family in the registry (DualPipe too) and the default
micro-batch counts (64, 128, 256), one core.

    python benchmarks/planner/plan_speed.py [--ranks 64] [--layers 128] [--memory-gib G]
        [--prune]

Prints the CPU time of the search (``time.process_time``: what one core spends; the wall time
too, which is larger on a shared machine) against the target (issue 50: under 10 s of CPU at
64 ranks × 128 layers), the number of simulated candidates, and the pick; ``--prune`` skips the
refinement moves a lower bound proves slower (``search(prune=True)``: the same pick). Results are
quoted in docs/planning.md and docs/results/cpu-2026-12-02-schedule-scale/.
"""

from __future__ import annotations

import argparse
import time

from pipetrain.planner.costs_file import LayerCost, ModelCosts
from pipetrain.planner.search import Search, search
from pipetrain.schedule.registry import FAMILIES


def llama_like(num_layers: int) -> ModelCosts:
    """Embedding cheap in time and heavy in parameters, head heavy in both, blocks alike."""

    def layer(name, f, i, w, act, params):
        return LayerCost(
            name=name, forward=f, backward_input=i, backward_weight=w, backward=i + w,
            activation=act, params=params,
        )  # fmt: skip

    blocks = [layer(f"block{n}", 1.0, 1.0, 1.0, 0.25, 0.8) for n in range(num_layers - 2)]
    return ModelCosts(
        layers=(
            layer("embed", 0.1, 0.0, 0.3, 0.02, 6.0),
            *blocks,
            layer("head", 3, 3, 3, 1.0, 6.0),
        ),
        comm=0.05,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--memory-gib", type=float, default=60.0)
    parser.add_argument(
        "--prune",
        action="store_true",
        help="skip the refinement moves a lower bound proves slower than the best",
    )
    args = parser.parse_args()
    costs = llama_like(args.layers)
    start, cpu = time.perf_counter(), time.process_time()
    found = search(
        costs,
        num_ranks=args.ranks,
        memory_gib=args.memory_gib,
        schedules=list(FAMILIES),
        prune=args.prune,
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    target = " (target: under 10 s of CPU)" if (args.ranks, args.layers) == (64, 128) else ""
    print(
        f"{args.ranks} ranks x {args.layers} layers, {len(FAMILIES)} families"
        f"{', pruned' if args.prune else ''}: "
        f"{len(found.candidates)} candidates simulated, {len(found.skipped)} shapes skipped, "
        f"{cpu:.1f} s CPU ({elapsed:.1f} s wall){target}"
    )
    print(summary(found))


def summary(found: Search) -> str:
    """The pick, then each family's best: what ``pipetrain plan`` prints, in brief (the library's
    ``Search``, not the command line's wording)."""
    best = found.best.plan
    lines = [
        f"plan: {best.schedule}, {best.ranks} ranks x {best.stages_per_rank} stage(s), "
        f"{best.microbatches} micro-batches, stage_layers {list(best.stage_layers)}",
        f"predicted: step {best.step_ms:.3f} ms, bubble {best.bubble_fraction:.1%}, "
        f"peak GiB {max(best.peak_gib):.2f} (budget {best.memory_gib:g})",
    ]
    for c in found.best_per_family():
        plan = c.plan
        lines.append(
            f"  {plan.schedule:<14} {plan.ms_per_microbatch:8.3f} ms per micro-batch, "
            f"bubble {plan.bubble_fraction:6.1%}, peak {max(plan.peak_gib):6.2f} GiB"
            + ("" if plan.fits else " (does not fit)")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
