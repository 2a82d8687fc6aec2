"""The refinement's pruning by a lower bound (``cuts.refine``) picks what the exhaustive
refinement picks, on random small models where it prunes."""

from __future__ import annotations

import random

from pipetrain.planner import LayerCost, ModelCosts
from pipetrain.planner.search import search


def _random_model(rng: random.Random) -> ModelCosts:
    layers = []
    for n in range(rng.randint(4, 8)):
        f = rng.uniform(0.2, 3.0)
        i, w = f * rng.uniform(0.5, 1.5), f * rng.uniform(0.3, 1.2)
        layers.append(
            LayerCost(
                name=f"l{n}",
                forward=f,
                backward_input=i,
                backward_weight=w,
                backward=i + w,
                activation=rng.uniform(0.0, 1.0),
                params=rng.uniform(0.0, 1.0),
            )
        )
    return ModelCosts(layers=tuple(layers), comm=rng.choice([0.0, 0.2]))


def test_pruned_pick_is_the_exhaustive_pick() -> None:
    rng = random.Random(5)
    pruned_somewhere = 0
    for _ in range(40):
        costs, ranks = _random_model(rng), rng.choice([2, 3])
        families = rng.sample(["1f1b", "zb-h1", "interleaved-1f1b", "zbv"], 2)
        memory = rng.choice([100.0, 6.0])
        kwargs = dict(
            num_ranks=ranks,
            memory_gib=memory,
            schedules=families,
            microbatches=[rng.choice([2, 4, 6])],
        )
        fast = search(costs, prune=True, **kwargs)  # type: ignore[arg-type]
        full = search(costs, **kwargs)  # type: ignore[arg-type]
        if not full.fitting:
            assert not fast.fitting
            continue
        assert fast.best.plan == full.best.plan
        assert [c.plan.schedule for c in fast.best_per_family()] == [
            c.plan.schedule for c in full.best_per_family()
        ]
        assert {c.plan for c in fast.candidates} <= {c.plan for c in full.candidates}
        pruned_somewhere += len(full.candidates) - len(fast.candidates)
    assert pruned_somewhere > 0  # the bound did prune, so the equality says something
