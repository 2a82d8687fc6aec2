"""Synthesized programs run by ``pipetrain.Pipeline``: float64 on gloo, loss and every gradient
equal to unsplit training, for a greedy order on the V placement (two stages per rank, a heavy
last stage under a tight memory cap) and on one stage per rank. The programs are built from
costs in every process (pure Python, deterministic) and handed to ``Pipeline`` as data."""

from __future__ import annotations

import pytest
from runtime_cases import batch, build_stages, differences, loss_fn, reference
from runtime_harness import launch

from pipetrain.planner import LayerCost, ModelCosts
from pipetrain.planner.judge import Budget
from pipetrain.planner.synthesize import synthesize_orders
from pipetrain.schedule.placement import one_per_rank, v_shape
from pipetrain.schedule.program import Program
from pipetrain.schedule.registry import build_schedule

MICROBATCHES = 5


def heavy_head(num_stages: int) -> ModelCosts:
    """One layer per stage, the last three times as slow and as large as the others."""
    layers = tuple(
        LayerCost(
            name=f"s{s}",
            forward=3.0 if s == num_stages - 1 else 1.0,
            backward_input=3.0 if s == num_stages - 1 else 1.0,
            backward_weight=2.0 if s == num_stages - 1 else 0.8,
            backward=5.0 if s == num_stages - 1 else 1.8,
            activation=3.0 if s == num_stages - 1 else 1.0,
            params=0.0,
        )
        for s in range(num_stages)
    )
    return ModelCosts(layers=layers, comm=0.1)


def programs(world: int) -> list[tuple[str, Program]]:
    out = []
    for name, placement in (("v", v_shape(world)), ("one per rank", one_per_rank(world))):
        costs = heavy_head(placement.num_stages)
        cap = Budget(7.0 if name == "v" else 9.0, 0.0)
        found = synthesize_orders(
            costs, placement, MICROBATCHES, (1,) * placement.num_stages, cap, order_budget=40
        )
        assert found is not None, name
        out.append((name, found.program))
    return out


def run_programs(rank: int, world: int) -> list[str]:
    import pipetrain

    failures = []
    for name, program in programs(world):
        stages = build_stages(program.num_stages)
        pipe = pipetrain.Pipeline(stages, schedule=program, loss_fn=loss_fn)
        inputs, y = batch(2 * MICROBATCHES + 1, seed=3)
        losses = [pipe.step(inputs, y) for _ in range(2)]
        ref_loss, ref_grads = reference(program.num_stages, inputs, y, steps=2)
        failures += differences(
            f"synthesized {name}", pipe, stages, rank, losses, ref_loss, ref_grads
        )
    return failures


def test_synthesized_programs_are_new() -> None:
    """What the runtime test runs is none of the families' programs."""
    for name, program in programs(2):
        family = "zbv" if name == "v" else "zb-h1"
        assert program.actions != build_schedule(family, 2, MICROBATCHES).actions, name


@pytest.mark.slow
def test_synthesized_programs_match_unsplit_training() -> None:
    failures = launch(2, run_programs, timeout=120)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)
