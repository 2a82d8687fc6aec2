"""The planner's activation offload: a stage's copies timed at the costs file's host bandwidth on
the simulator's copy engine, offload planned only when nothing fits without, only on stages whose
micro-batches wait long enough, and ``NoPlanFits`` only when full recompute with full offload does
not fit (PipeOffload, arXiv 2503.01328)."""

from __future__ import annotations

import dataclasses

import pytest

from pipetrain.planner import Layout, ModelCosts, NoPlanFits, plan, search
from pipetrain.planner.costs_file import LayerCost
from pipetrain.planner.judge import (
    Budget,
    evaluate,
    planned_offload,
    stage_costs,
    usable_offload,
)
from pipetrain.planner.search import simulate_plan
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.registry import build_schedule


def block(name: str) -> LayerCost:
    return LayerCost(
        name=name, forward=1.0, backward_input=1.0, backward_weight=1.0, backward=2.0,
        activation=1.0, params=0.1, recompute=0.8, recompute_activation=0.05,
    )  # fmt: skip


def costs(bandwidth: float | None, num_layers: int = 8) -> ModelCosts:
    layers = tuple(block(f"l{i}") for i in range(num_layers))
    return ModelCosts(layers=layers, host_bandwidth_gbs=bandwidth)


def test_copies_last_their_share_of_the_activation_over_the_host_bandwidth() -> None:
    program = build_schedule("1f1b", 4, 8)
    sc = stage_costs(costs(2**30 / 1e9), program, (2, 2, 2, 2), (), (1.0, 0.5, 0.5, 0.0))
    # 2 GiB of activation per stage at 1 GiB/s: 2000 ms one way
    assert sc.host_copy == pytest.approx([2000.0] * 4)
    assert sc.offload == [1.0, 0.5, 0.5, 0.0]
    fast = costs(1e6)
    timeline, peaks = simulate_plan(fast, program, (2, 2, 2, 2), (), (1.0, 1.0, 1.0, 0.0))
    _, plain = simulate_plan(fast, program, (2, 2, 2, 2))
    kinds = {s.action.kind for s in timeline.copies}
    assert kinds == {OpKind.OFFLOAD, OpKind.RELOAD}
    assert peaks[0] < plain[0] and peaks[3] == pytest.approx(plain[3])
    assert sc.layers == [2, 2, 2, 2]  # offload moves each stage's first layers, layer by layer
    # copies slower than compute: the backwards wait, and the planner sees it ...
    slow = costs(200.0)
    offload, leads = planned_offload(slow, program, (2, 2, 2, 2), (), (1.0, 1.0, 1.0, 0.0))
    assert offload == (1.0, 1.0, 1.0, 0.0) and leads[0] > 1  # reloads issued further ahead
    waited, _ = simulate_plan(slow, program, (2, 2, 2, 2), (), offload)
    assert waited.makespan > timeline.makespan
    # ... no more than with the reloads one action ahead of their backward
    late, _ = simulate_plan(slow, program, (2, 2, 2, 2), (), offload, (1, 1, 1, 1))
    assert late.makespan >= waited.makespan - 1e-9


def test_stages_that_cannot_offload_plan_zero() -> None:
    program = build_schedule("1f1b", 2, 4)  # the last stage's backward follows its forward
    assert usable_offload(program, 2, (1.0, 1.0)) == (1.0, 0.0)
    judged = evaluate(costs(1e5), program, "1f1b", 1, (4, 4), "offload", Budget(1e3, 0), (),
                      (1.0, 1.0))  # fmt: skip
    assert judged.plan.offload == (1.0, 0.0)
    assert judged.plan.to_json()["reload_lead"] == [1, 1]  # every layer moved: reload one ahead
    judged = evaluate(costs(1e5), program, "1f1b", 1, (4, 4), "offload", Budget(1e3, 0), (),
                      (0.5, 1.0))  # fmt: skip
    layout = Layout.from_json(judged.plan.to_json())
    assert layout.offload == (0.5, 0.0) and layout.reload_lead == judged.plan.layout.reload_lead
    # fast copies and two kept layers: the reloads go right before their backward (lead 0) ...
    assert judged.plan.to_json()["reload_lead"] == [0, 1]
    # ... and Pipeline.from_plan runs them there
    spec = layout.offload_spec
    assert spec is not None and spec.leads(2) == (0, 1)


def test_offload_only_when_nothing_fits_and_only_with_a_measured_bandwidth() -> None:
    roomy = search(costs(1e5), num_ranks=2, memory_gib=1000, headroom=0)
    assert not roomy.best.plan.layout.offloads and not roomy.offload_tried
    low = min(max(c.plan.peak_gib) for c in roomy.candidates)
    tight = search(costs(1e5), num_ranks=2, memory_gib=low * 0.6, headroom=0)
    pick = tight.best.plan
    assert tight.offload_tried and pick.fits and pick.layout.offloads
    # copies this fast are free: offload beats recomputing, which pays in time
    assert pick.ms_per_microbatch == pytest.approx(roomy.best.plan.ms_per_microbatch)
    without = search(costs(None), num_ranks=2, memory_gib=low * 0.6, headroom=0)
    assert not without.offload_tried
    assert not any(c.plan.layout.offloads for c in without.candidates)
    # a run replayed as a CUDA graph cannot offload: the planner recomputes instead
    graphed = search(costs(1e5), num_ranks=2, memory_gib=low * 0.6, headroom=0, offload=False)
    assert not graphed.offload_tried and graphed.best.plan.fits
    assert not any(c.plan.layout.offloads for c in graphed.candidates)
    assert graphed.best.plan.layout.recomputes


def test_nothing_fits_even_with_full_recompute_and_full_offload_names_the_gib() -> None:
    with pytest.raises(NoPlanFits, match=r"even with full recompute and full offload on every "
                       r"stage: the smallest peak any candidate reached is [\d.]+ GiB"):  # fmt: skip
        plan(costs(1e5), num_ranks=2, memory_gib=0.5, headroom=0)


def test_selective_recompute_with_offload_on_one_stage_is_refused() -> None:
    old = {"schedule": "1f1b", "ranks": 2, "stages_per_rank": 1, "microbatches": 4,
           "stage_layers": [3, 3]}  # fmt: skip
    with pytest.raises(ValueError, match=r"stage\(s\) 0 recompute 'selective' and offload"):
        Layout.from_json({**old, "recompute": ["selective", "none"], "offload": [0.5, 0.0]})
    both = Layout.from_json({**old, "recompute": ["full", "selective"], "offload": [0.5, 0.0]})
    assert both.offloads and both.recomputes


def test_at_equal_speed_the_pick_offloads_and_recomputes_least() -> None:
    """Copies the simulator hides still move bytes: between plans of equal predicted speed the
    one that offloads less wins, then the one that recomputes less, before the lower peak."""
    from pipetrain.planner.judge import rank_key

    program = build_schedule("interleaved-1f1b", 2, 8, 2)
    budget, cut = Budget(1e3, 0), (2, 2, 2, 2)
    full = ("full",) * 4
    fast = costs(1e6)
    recomputed = evaluate(fast, program, "interleaved-1f1b", 2, cut, "full", budget, full)
    both = evaluate(fast, program, "interleaved-1f1b", 2, cut, "both", budget, full, (1.0,) * 4)
    assert both.plan.step_ms == pytest.approx(recomputed.plan.step_ms)  # the copies hide
    assert max(both.plan.peak_gib) < max(recomputed.plan.peak_gib)
    assert rank_key(recomputed) < rank_key(both)
    plain = evaluate(fast, program, "interleaved-1f1b", 2, cut, "plain", budget)
    tied = dataclasses.replace(
        recomputed, plan=dataclasses.replace(recomputed.plan, step_ms=plain.plan.step_ms)
    )
    assert rank_key(plain) < rank_key(tied)  # at equal speed, the one that recomputes less
