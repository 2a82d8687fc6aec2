"""Synthesized schedules against the planner's pick on profiled costs (docs/synthesis.md).

    .venv/bin/python benchmarks/planner/synthesize_cases.py --out docs/results/sim-2026-12-02-synthesized

Every case starts from the costs file profiled on an H200 for a Llama-3-shaped GPT (vocabulary
128,256, hidden 2048, 16 blocks, sequence 1024, micro-batch 2, bfloat16; the embedding and the
head with its loss as layers of their own: ``docs/results/h200x2-2026-11-28-plan-cuda-graph-
sustained3``). The other two are derived from it: the head and the embedding scaled with the
vocabulary (their times and memory are the vocabulary's GEMMs, gradients and logits), and fewer
blocks. Per case: the planner's pick at that micro-batch count and budget (``pipetrain.plan``'s
search, no offload) and the synthesized program (``pipetrain synthesize``), both simulated on the
same costs; with ``--out``, each one's SVG and a ``cases.json``. Pure Python (no torch).

``--sweep G1,G2,...`` prints every case at those budgets instead (how the budgets were chosen:
each case's is one where the zero-bubble families' peaks do not fit and the planner falls back).

``--gap SEEDS`` measures the heuristic's optimality gap instead: per seed, random tiny models
(one layer per stage, one stage per rank; layer times varying 15x, with and without comm;
memory caps from one micro-batch's activations per rank to none) on 2 ranks x 3 micro-batches,
3 x 2 and 4 x 2, the heuristic's order (``synthesize_orders``) against the exact optimum over
every order (``synthesize_exact``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from pipetrain.planner import ModelCosts
from pipetrain.planner.costs_file import LayerCost, load_costs
from pipetrain.planner.judge import Budget, Plan, stage_costs
from pipetrain.planner.synthesize import Synthesis, synthesize, synthesize_orders
from pipetrain.planner.synthesize_exact import exact_best
from pipetrain.render.svg import render_svg
from pipetrain.schedule.placement import one_per_rank
from pipetrain.schedule.registry import build_schedule
from pipetrain.sim.costs import per_rank

PROFILED = (
    Path(__file__).resolve().parents[2]
    / "docs/results/h200x2-2026-11-28-plan-cuda-graph-sustained3/costs.json"
)
#: the fields of a layer that grow with the vocabulary (the embedding's and the head's)
_VOCAB_FIELDS = (
    "forward",
    "backward_input",
    "backward_weight",
    "backward",
    "activation",
    "activation_for_weight",
    "params",
    "workspace",
    "optimizer_workspace",
    "recompute",
    "recompute_activation",
    "selective_activation",
    "selective_recompute",
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    costs: ModelCosts
    ranks: int
    microbatches: int
    memory_gib: float


def scaled(layer: LayerCost, factor: float) -> LayerCost:
    """``layer`` with what grows with the vocabulary multiplied by ``factor``."""
    changes = {
        f: getattr(layer, f) * factor for f in _VOCAB_FIELDS if getattr(layer, f) is not None
    }
    return dataclasses.replace(layer, **changes)


def vocabulary(costs: ModelCosts, factor: float, tied: bool) -> ModelCosts:
    """The embedding and the head scaled to ``factor`` times the vocabulary. ``tied``: one
    weight shared by both ends, which in a pipeline each end holds with its optimizer state
    (Megatron-LM's embedding group; the gradient sum between them is outside the step): the
    embedding's static memory is the head's."""
    embed, *blocks, head = costs.layers
    head = scaled(head, factor)
    embed = scaled(embed, factor)
    if tied:
        embed = dataclasses.replace(embed, params=head.params)
    return dataclasses.replace(costs, layers=(embed, *blocks, head))


def fewer_blocks(costs: ModelCosts, blocks: int) -> ModelCosts:
    embed, *rest, head = costs.layers
    return dataclasses.replace(costs, layers=(embed, *rest[:blocks], head))


def cases() -> list[Case]:
    profiled = load_costs(str(PROFILED))
    return [
        Case("heavy head, 128k vocabulary (as profiled)", profiled, 4, 8, 7.0),
        Case(
            "256k vocabulary, tied embedding",
            vocabulary(profiled, 2.0, tied=True),
            4,
            8,
            14.0,
        ),
        Case(
            "13 blocks + embedding + head on 4 ranks (15 layers)",
            fewer_blocks(profiled, 13),
            4,
            8,
            6.0,
        ),
    ]


def head_bound(costs: ModelCosts, microbatches: int) -> float:
    """A lower bound on any program's step, whatever its cut, placement or memory: the rank
    holding the heaviest layer runs that layer's forward and backward for every micro-batch, and
    cannot start before the first micro-batch's forward has crossed every layer ahead of it."""
    work = [x.forward + min(x.backward, _split(x)) for x in costs.layers]
    h = work.index(max(work))
    return sum(x.forward for x in costs.layers[:h]) + microbatches * work[h]


def _split(layer: LayerCost) -> float:
    if layer.backward_input is None or layer.backward_weight is None:
        return float("inf")
    return layer.backward_input + layer.backward_weight


def row(case: Case, result: Synthesis, seconds: float) -> dict[str, object]:
    base = result.baseline
    return {
        "bound_ms": head_bound(case.costs, case.microbatches),
        "case": case.name,
        "ranks": case.ranks,
        "microbatches": case.microbatches,
        "memory_gib": case.memory_gib,
        "planner": {
            "schedule": base.schedule,
            "stages_per_rank": base.stages_per_rank,
            "stage_layers": list(base.stage_layers),
            "recompute": list(base.recompute),
            "step_ms": base.step_ms,
            "peak_gib": list(base.peak_gib),
        },
        "synthesized": {
            **result.to_json(),
            "program": [list(map(str, r)) for r in result.program.actions],
        },
        "speedup": result.speedup,
        "seconds": seconds,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="folder for the SVGs and cases.json")
    p.add_argument("--sweep", help="budgets (GiB) to try every case at, instead of its own")
    p.add_argument("--gap", help="seeds: measure the optimality gap on tiny models instead")
    args = p.parse_args()
    if args.gap:
        return gap([int(x) for x in args.gap.split(",")])
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, case in enumerate(cases(), start=1):
        budgets = [float(g) for g in args.sweep.split(",")] if args.sweep else [case.memory_gib]
        for gib in budgets:
            case = dataclasses.replace(case, memory_gib=gib)
            start = time.process_time()
            try:
                result = synthesize(
                    case.costs,
                    num_ranks=case.ranks,
                    num_microbatches=case.microbatches,
                    memory_gib=gib,
                )
            except ValueError as e:
                print(f"{case.name} at {gib:g} GiB: {str(e).splitlines()[0][:90]}")
                continue
            rows.append(row(case, result, time.process_time() - start))
            base = result.baseline
            print(
                f"{case.name} | p={case.ranks} M={case.microbatches} {gib:g} GiB | planner "
                f"{base.schedule} v={base.stages_per_rank} {list(base.stage_layers)} "
                f"{base.step_ms:.2f} ms | synthesized {list(result.stage_layers)} "
                f"{result.step_ms:.2f} ms | {result.speedup:.3f}x | bound "
                f"{rows[-1]['bound_ms']:.2f} ms | {result.how} | "
                f"{rows[-1]['seconds']:.1f} s CPU"
            )
            if out and not args.sweep:
                _draw(out, n, case.costs, result)
    if out and not args.sweep:
        (out / "cases.json").write_text(json.dumps(rows, indent=1))
    return 0


def planner_static(costs: ModelCosts, plan: Plan) -> tuple[float, ...]:
    """Each rank's static memory under the planner's pick (what its activations stand on)."""
    program = build_schedule(plan.schedule, plan.ranks, plan.microbatches, plan.stages_per_rank)
    static = stage_costs(costs, program, plan.stage_layers).per_stage(program.num_stages).static
    return tuple(per_rank(static, program.placement.rank_of_stage, plan.ranks))


#: (ranks, micro-batches) of the tiny models; models per seed and shape
GAP_SHAPES = ((2, 3), (3, 2), (4, 2))
GAP_MODELS = 10


def tiny_model(rng: random.Random, ranks: int) -> tuple[ModelCosts, float]:
    """A model of one layer per rank and a memory cap of 1, 2 or 3 micro-batches' activations
    on the largest stage, or none."""
    layers = []
    for n in range(ranks):
        f = rng.uniform(0.2, 3)
        i, w = f * rng.uniform(0.5, 1.5), f * rng.uniform(0.3, 1.2)
        act = rng.uniform(0.2, 1)
        layers.append(
            LayerCost(
                name=f"l{n}",
                forward=f,
                backward_input=i,
                backward_weight=w,
                backward=i + w,
                activation=act,
                params=0.0,
            )
        )
    biggest = max(x.activation for x in layers)
    cap = rng.choice([1, 2, 3, 0]) * biggest
    return ModelCosts(layers=tuple(layers), comm=rng.choice([0.0, 0.2])), cap or float("inf")


def gap(seeds: list[int]) -> int:
    start = time.process_time()
    print(f"{'ranks x M':<10} {'models':>6} {'optimal':>7} {'mean gap':>9} {'worst':>7}")
    for ranks, m in GAP_SHAPES:
        gaps = []
        for seed in seeds:
            rng = random.Random(seed * 100 + ranks)
            for _ in range(GAP_MODELS):
                costs, cap = tiny_model(rng, ranks)
                budget = Budget(cap, 0.0)
                cut = (1,) * ranks
                found = synthesize_orders(costs, one_per_rank(ranks), m, cut, budget)
                exact = exact_best(costs, one_per_rank(ranks), m, cut, (), budget)
                if found is None or exact is None:
                    continue
                # the heuristic searches inside the exact space: never below it but for float sums
                ratio = found.makespan / exact.makespan - 1
                assert ratio > -1e-9, (seed, ranks, m, ratio)
                gaps.append(max(ratio, 0.0))
        optimal = sum(g < 1e-9 for g in gaps)
        mean = sum(gaps) / len(gaps)
        print(f"{ranks} x {m:<6} {len(gaps):>6} {optimal:>7} {mean:>9.2%} {max(gaps):>7.2%}")
    print(f"{time.process_time() - start:.1f} s CPU")
    return 0


def _draw(out: Path, n: int, costs: ModelCosts, result: Synthesis) -> None:
    base = result.baseline
    limit = base.usable_gib
    (out / f"case{n}-synthesized.svg").write_text(
        render_svg(
            result.timeline,
            title=f"synthesized: {result.step_ms:.1f} ms, stage_layers {list(result.stage_layers)}",
            memory=True,
            static=result.static_gib,
            limit=limit,
        )
    )
    (out / f"case{n}-planner.svg").write_text(
        render_svg(
            result.baseline_timeline,
            title=f"planner's pick, {base.schedule}: {base.step_ms:.1f} ms, stage_layers "
            f"{list(base.stage_layers)}",
            memory=True,
            static=planner_static(costs, base),
            limit=limit,
        )
    )


if __name__ == "__main__":
    raise SystemExit(main())
