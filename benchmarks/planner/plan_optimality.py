"""How near the planner's pick is to the best cut, on small models where every cut can be
simulated (docs/planning.md, "How near to optimal").

    .venv/bin/python benchmarks/planner/plan_optimality.py --seeds 1,7,11

Per seed, 60 random models (4-9 layers, 2 or 3 ranks, layer times varying 15x, with and without
comm, 2 x ranks micro-batches); per model and family, the pick's simulated step against the
fastest of every contiguous cut's. Prints, per family, how many picks were the exhaustive best,
how many were more than 1% above it, and the worst ratio. Pure Python (no torch).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from itertools import combinations, pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from pipetrain.planner import LayerCost, ModelCosts, search
from pipetrain.planner.search import simulate_plan
from pipetrain.schedule.registry import build_schedule

FAMILIES = (("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2), ("zbv", 2))


def random_model(rng: random.Random) -> tuple[ModelCosts, int]:
    num_layers, ranks = rng.randint(4, 9), rng.choice([2, 3])
    layers = []
    for n in range(num_layers):
        f = rng.uniform(0.2, 3)
        i, w = f * rng.uniform(0.5, 1.5), f * rng.uniform(0.3, 1.2)
        layers.append(
            LayerCost(name=f"l{n}", forward=f, backward_input=i, backward_weight=w,
                      backward=i + w, activation=rng.uniform(0, 1), params=0.0)
        )  # fmt: skip
    return ModelCosts(layers=tuple(layers), comm=rng.choice([0.0, 0.2])), ranks


def exhaustive_best(costs: ModelCosts, name: str, ranks: int, m: int, v: int) -> float:
    program = build_schedule(name, ranks, m, v)
    n = costs.num_layers
    return min(
        simulate_plan(costs, program, tuple(b - a for a, b in pairwise((0, *ends, n))))[0].makespan
        for ends in combinations(range(1, n), program.placement.stages_per_chain - 1)
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="1,7,11")
    p.add_argument("--models", type=int, default=60)
    args = p.parse_args()
    ratios: dict[str, list[float]] = {name: [] for name, _ in FAMILIES}
    start = time.process_time()
    for seed in (int(s) for s in args.seeds.split(",")):
        rng = random.Random(seed)
        for _ in range(args.models):
            costs, ranks = random_model(rng)
            for name, v in FAMILIES:
                if v * ranks > costs.num_layers:
                    continue
                m = 2 * ranks
                found = search(costs, num_ranks=ranks, memory_gib=1e9, schedules=[name],
                               microbatches=[m], stages_per_rank=[v])  # fmt: skip
                best = exhaustive_best(costs, name, ranks, m, v)
                ratios[name].append(found.best.plan.step_ms / best - 1)
    print(f"{'family':<18} {'models':>6} {'exact':>6} {'> 1%':>5} {'worst':>7}")
    for name, rs in ratios.items():
        exact = sum(r < 1e-9 for r in rs)
        over = sum(r > 0.01 for r in rs)
        print(f"{name:<18} {len(rs):>6} {exact:>6} {over:>5} {max(rs):>7.2%}")
    print(f"{time.process_time() - start:.1f} s CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
