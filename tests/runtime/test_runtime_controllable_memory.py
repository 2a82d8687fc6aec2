"""V-Half and V-Min run by ``pipetrain.Pipeline``: float64 on gloo, loss and gradients equal
unsplit training, at 2 and 4 ranks (one launch each): just past the ranks, where the reordered
warm-up meets the cool-down, with I/W split by deferred weight GEMMs, and well past twice the
ranks (a steady state between them) with graph replay. (test_runtime_equivalence runs both at
1, 2 and 4 ranks with the fewest micro-batches too.)
"""

from __future__ import annotations

import pytest
from runtime_cases import batch, build_stages, differences, loss_fn, reference
from runtime_harness import launch

NAMES = ["v-half", "v-min"]


def cases(world: int) -> list[tuple[int, bool]]:
    """(micro-batches, defer_weight_grads)."""
    return [(world + 1, True), (2 * world + 3, False)]


def run_cases(rank: int, world: int) -> list[str]:
    import pipetrain

    failures = []
    for name in NAMES:
        for m, defer in cases(world):
            num_stages = 2 * world
            stages = build_stages(num_stages)
            pipe = pipetrain.Pipeline(
                stages,
                schedule=name,
                num_microbatches=m,
                loss_fn=loss_fn,
                defer_weight_grads=defer,
            )
            inputs, y = batch(2 * m + 1, seed=m)
            losses = [pipe.step(inputs, y) for _ in range(2)]
            ref_loss, ref_grads = reference(num_stages, inputs, y, steps=2)
            case = f"{name} ranks={world} m={m} defer_weight_grads={defer}"
            failures += differences(case, pipe, stages, rank, losses, ref_loss, ref_grads)
    return failures


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_v_schedules_match_unsplit_training(world: int) -> None:
    failures = launch(world, run_cases, timeout=150)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)
