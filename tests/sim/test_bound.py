"""The step lower bound (``sim.bound``) never exceeds the simulated step, is exact where the
fill-and-drain argument is, and the activation peaks read without the curves equal the curves'."""

from __future__ import annotations

import gc
import random

import pytest

from pipetrain.schedule.gc_pause import gc_paused, without_gc
from pipetrain.schedule.registry import FAMILIES, build_schedule
from pipetrain.sim.bound import count_actions, step_lower_bound
from pipetrain.sim.costs import Costs
from pipetrain.sim.simulate import simulate


def _random_costs(rng: random.Random, num_stages: int) -> Costs:
    def per_stage() -> list[float]:
        return [rng.choice([0.0, rng.uniform(0.0, 3.0)]) for _ in range(num_stages)]

    return Costs(
        forward=per_stage(),
        backward_input=per_stage(),
        backward_weight=per_stage(),
        comm=per_stage(),
        activation=per_stage(),
        activation_for_weight=per_stage(),
    )


@pytest.mark.parametrize("seed", range(3))
def test_bound_never_exceeds_the_simulated_step(seed: int) -> None:
    rng = random.Random(seed)
    checked = 0
    for _ in range(60):
        name = rng.choice(list(FAMILIES))
        try:
            program = build_schedule(name, rng.randint(1, 4), rng.randint(1, 9))
        except ValueError:
            continue  # the family refuses this shape
        costs = _random_costs(rng, program.num_stages)
        timeline = simulate(program, costs)
        bound = step_lower_bound(count_actions(program), costs)
        assert bound is not None
        assert bound <= timeline.makespan * (1 + 1e-12) + 1e-12, (name, program.num_ranks)
        # the peaks read without the curves are the curves' peaks
        fresh = simulate(program, costs)
        assert fresh.peak_activations == tuple(max(h for _, h in c) for c in timeline.memory)
        checked += 1
    assert checked > 30


@pytest.mark.parametrize(("ranks", "microbatches"), [(4, 8), (6, 3)])
def test_bound_is_the_step_of_1f1b_and_gpipe_on_equal_stages(ranks: int, microbatches: int) -> None:
    # one stage per rank, equal stages, no comm: the step is (M + P - 1)(F + B), which fill +
    # work + drain states (with comm, 1F1B's steady state pays it too and the bound is below)
    costs = Costs(forward=1.0, backward_input=1.5, backward_weight=0.5)
    for name in ("1f1b", "gpipe"):
        program = build_schedule(name, ranks, microbatches)
        bound = step_lower_bound(count_actions(program), costs)
        assert bound == pytest.approx(simulate(program, costs).makespan, rel=1e-12)


def test_no_bound_where_the_plain_model_does_not_apply() -> None:
    program = build_schedule("1f1b", 2, 4)
    weighted = Costs(microbatch_weights=[1.0, 2.0, 1.0, 0.5])
    assert step_lower_bound(count_actions(program), weighted) is None
    paired = build_schedule("dualpipev", 2, 8)
    measured_pairs = Costs(forward_backward=1.0)
    assert step_lower_bound(count_actions(paired), measured_pairs) is None


def test_gc_pause_nests_and_always_restores() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # only the outermost pause resumes
    assert gc.isenabled()

    @without_gc
    def fails() -> None:
        assert not gc.isenabled()
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        fails()
    assert gc.isenabled()
