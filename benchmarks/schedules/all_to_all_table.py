"""How much of a DeepSeek-V3-like stage's expert all-to-all each schedule hides, simulated.

Sixteen equal mixture-of-experts layers (a slice of a DeepSeek-V3-like model: hidden 7168, top-8
of 256 routed experts, one shared expert, multi-latent attention) on 4 pipeline ranks, 16
micro-batches of one 4,096-token sequence, BF16. Per layer and micro-batch: forward 14 ms,
input gradient 14 ms, weight gradient 14 ms (about 5.5 TFLOP forward at 400 TFLOP/s);
dispatched bytes 4096 × 8 × 7168 × 2 × 63/64 (expert parallel 64: what leaves the rank),
dispatch and combine each way; the activation sent between stages 4096 × 7168 × 2 bytes at 50
GB/s (1.2 ms) whatever the expert link. Every schedule cuts the layers evenly (4 per stage with one stage per rank,
2 with two) and runs the same micro-batches; the planner's own stage costs
(``planner.judge.stage_costs``) price each stage. Prints a markdown table per link speed and the
raw numbers as JSON (``--json``).

Run from the repository root: ``python benchmarks/schedules/all_to_all_table.py`` (results:
docs/results/sim-2026-12-02-all-to-all/README.md)
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from pipetrain.planner.costs_file import LayerCost, ModelCosts
from pipetrain.planner.judge import stage_costs
from pipetrain.schedule.lower import lower
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.all_to_all import all_to_all_share
from pipetrain.sim.simulate import simulate

RANKS, MICROBATCHES, LAYERS = 4, 16, 16
TOKENS, TOP_K, HIDDEN, EP = 4096, 8, 7168, 64
DISPATCHED = TOKENS * TOP_K * HIDDEN * 2 * (EP - 1) / EP
SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2), ("dualpipev", 2))
LINKS_GBS = (25.0, 50.0, 100.0, 200.0)
#: the activation one stage sends the next, 4096 × 7168 × 2 bytes at 50 GB/s, whatever the expert
#: link (pipeline transfers are few and small beside the all-to-all)
COMM_MS = TOKENS * HIDDEN * 2 / 50e6
HEADER = (
    "| schedule | step (ms) | step without all-to-all (ms) | all-to-all per rank (ms) | hidden |"
)


def model(link_gbs: float | None) -> ModelCosts:
    layer = LayerCost(
        name="moe",
        forward=14.0,
        backward_input=14.0,
        backward_weight=14.0,
        backward=28.0,
        activation=1.0,
        params=1.0,
        dispatched_bytes=DISPATCHED,
    )
    layers = tuple(dataclasses.replace(layer, name=f"layers.{i}") for i in range(LAYERS))
    return ModelCosts(layers=layers, comm=COMM_MS, ep_link_gbs=link_gbs)


def row(name: str, v: int, link_gbs: float) -> dict[str, object]:
    program = validate(lower(build_schedule(name, RANKS, MICROBATCHES, v)))
    cut = (LAYERS // (RANKS * v),) * (RANKS * v)
    with_a2a = stage_costs(model(link_gbs), program, cut)
    without = stage_costs(model(None), program, cut)
    share = all_to_all_share(program, with_a2a)
    return {
        "schedule": name,
        "stages_per_rank": v,
        "link_gbs": link_gbs,
        "step_ms": simulate(program, with_a2a).makespan,
        "step_without_all_to_all_ms": simulate(program, without).makespan,
        "all_to_all_ms_per_rank": max(share.total),
        "hidden_ms_per_rank": list(share.hidden),
        "hidden_share": share.hidden_share,
    }


def main() -> None:
    rows = [row(name, v, link) for link in LINKS_GBS for name, v in SCHEDULES]
    if "--json" in sys.argv:
        print(json.dumps(rows, indent=1))
        return
    per_layer = 2 * DISPATCHED / 50e6
    print(
        f"{LAYERS} MoE layers, {RANKS} ranks, {MICROBATCHES} micro-batches; per layer F = I = W "
        f"= 14 ms, dispatched {DISPATCHED / 1e6:.0f} MB ({per_layer:.1f} ms each way at 50 GB/s)"
    )
    for link in LINKS_GBS:
        print(f"\nexpert link {link:g} GB/s\n")
        print(HEADER)
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            if r["link_gbs"] == link:
                print(
                    f"| {r['schedule']} | {r['step_ms']:,.0f} | "
                    f"{r['step_without_all_to_all_ms']:,.0f} | "
                    f"{r['all_to_all_ms_per_rank']:,.0f} | {r['hidden_share']:.0%} |"
                )


if __name__ == "__main__":
    main()
