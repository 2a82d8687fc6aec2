"""How long an N-D plan takes at scale: 1,024 GPUs, 8 to a node, pp up to 64 with every tp × dp
split, for a Llama-70B-like stack (80 blocks, a heavy embedding and head) with tensor-parallel
degrees 2, 4 and 8 derived, a fixed global batch, every runnable family.

    python benchmarks/planner/nd_plan_speed.py [--gpus 1024] [--blocks 80] [--global-batch 1024]

Prints the CPU time (one core's; the wall time beside it, larger on a shared machine), the
shapes simulated and skipped by the bound, the pick and each simulated shape's best. The
issue's target is under 60 s. ``--exhaustive`` simulates every shape (the bound off);
``--explain`` also searches the runner-up exactly (``plan --explain``) and explains the pick.
"""

from __future__ import annotations

import argparse
import time

from pipetrain.planner.costs_file import LayerCost, ModelCosts
from pipetrain.planner.costs_file_tp import TpShape, derive
from pipetrain.planner.nd_explain import explain, shape_table
from pipetrain.planner.nd_search import Cluster, nd_search

#: a Llama-70B block at 4,096 tokens a micro-batch in bfloat16 on an H100-class GPU: ms, GiB
BLOCK = dict(forward=9.0, backward_input=9.0, backward_weight=9.0, activation=1.1, params=6.6)
#: hidden 8,192 x 4,096 tokens x 2 bytes: one all-reduce's bytes; two regions a block
HIDDEN_BYTES = 8192 * 4096 * 2


def llama70b_like(blocks: int, link_gbs: float) -> ModelCosts:
    """Blocks alike; the embedding light in time and heavy in parameters, the head heavy in
    both (a 128k vocabulary)."""

    def layer(name: str, numbers: dict[str, float], shape: TpShape) -> LayerCost:
        base = {**numbers, "gradients": numbers["params"] / 8}  # bf16 weights, fp32 states
        tp = tuple(derive(t, **base, shape=shape, link_gbs=link_gbs) for t in (2, 4, 8))
        b = numbers["backward_input"] + numbers["backward_weight"]
        return LayerCost(name=name, backward=b, tp=tp, **base)

    block = TpShape(7.5, 0.98, 0.7, 2 * HIDDEN_BYTES, 2 * HIDDEN_BYTES)
    embed = dict(forward=0.3, backward_input=0.0, backward_weight=1.0, activation=0.07, params=8.0)
    head = dict(forward=14.0, backward_input=14.0, backward_weight=14.0, activation=4.0, params=8.0)
    logits = 4096 * 128256 * 2
    return ModelCosts(
        layers=(
            layer("embed", embed, TpShape(0.0, 1.0, 0.0, HIDDEN_BYTES, 0.0)),
            *(layer(f"block{n}", BLOCK, block) for n in range(blocks)),
            layer("head", head, TpShape(13.0, 1.0, 0.9, 0.0, HIDDEN_BYTES, logits)),
        ),
        comm=0.2,
        tp_link_gbs=link_gbs,
        meta={"micro_batch_size": 1, "seq_len": 4096, "optimizer": "adamw"},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=1024)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=80)
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--memory-gib", type=float, default=80.0)
    parser.add_argument("--exhaustive", action="store_true")
    parser.add_argument(
        "--explain", action="store_true", help="also search the true runner-up and explain"
    )
    args = parser.parse_args()
    costs = llama70b_like(args.blocks, link_gbs=150.0)
    cluster = Cluster(
        gpus=args.gpus, gpus_per_node=args.gpus_per_node, link_gbs=150.0, node_link_gbs=25.0
    )
    start, cpu = time.perf_counter(), time.process_time()
    found = nd_search(
        costs,
        cluster,
        memory_gib=args.memory_gib,
        global_batch=args.global_batch,
        micro_batch_size=1,
        exhaustive=args.exhaustive,
        keep=2 if args.explain else 1,
    )
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    simulated = sum(r.simulated for r in found.shapes)
    skipped = sum(r.why.startswith("not simulated") for r in found.shapes)
    print(
        f"{args.gpus} GPUs ({args.gpus_per_node} a node), {costs.num_layers} layers: "
        f"{len(found.shapes)} shapes, {simulated} simulated, {skipped} skipped by the bound, "
        f"{len(found.shapes) - simulated - skipped} refused; "
        f"{cpu:.1f} s CPU ({elapsed:.1f} s wall)"
    )
    print("\n".join(shape_table(found)))
    if args.explain:
        print("\n".join(explain(found.best, found.runner_up, costs)))


if __name__ == "__main__":
    main()
