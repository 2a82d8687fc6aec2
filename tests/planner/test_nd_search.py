"""The N-D planner: costs file version 3 (tensor-parallel entries), the derivation of a degree,
the pp × tp × dp search against an exhaustive one, the layout's tp and dp, --explain's sums."""

from __future__ import annotations

import random

import pytest

from pipetrain.planner.costs_file import (
    VERSION,
    CostsFileError,
    LayerCost,
    ModelCosts,
    parse_costs,
)
from pipetrain.planner.costs_file_tp import TpShape, all_reduce_ms, derive
from pipetrain.planner.layout import Layout
from pipetrain.planner.nd_explain import breakdown, explain
from pipetrain.planner.nd_search import Cluster, Shape, nd_search, shape_costs, sync_ms
from pipetrain.planner.search import search
from pipetrain.schedule.registry import build_schedule

BLOCK = TpShape(0.6, 0.9, 0.5, 4e6, 4e6)


def _layer(name: str, f: float, params: float, degrees=(2, 4), shape=BLOCK, link=50.0):
    base = dict(forward=f, backward_input=f, backward_weight=f, activation=0.2, params=params)
    tp = tuple(derive(t, **base, gradients=params / 4, shape=shape, link_gbs=link) for t in degrees)
    return LayerCost(name=name, backward=2 * f, gradients=params / 4, tp=tp, **base)


def _costs(rng: random.Random, num_layers: int) -> ModelCosts:
    layers = [_layer("embed", 0.1, rng.uniform(0.5, 2))]
    layers += [
        _layer(f"b{i}", rng.uniform(0.5, 1.5), rng.uniform(0.2, 1)) for i in range(num_layers - 2)
    ]
    layers.append(_layer("head", rng.uniform(1, 3), rng.uniform(0.5, 2)))
    return ModelCosts(layers=tuple(layers), comm=0.05, meta={"micro_batch_size": 2, "seq_len": 8})


def test_version_3_round_trips_and_older_files_still_load() -> None:
    costs = _costs(random.Random(0), 4)
    data = costs.to_json()
    assert data["version"] == VERSION == 3
    back = parse_costs(data)
    assert back.layers == costs.layers and back.tp_degrees == (1, 2, 4)
    entry = data["layers"][1]["tp"][0]
    assert entry["source"] == "derived" and entry["degree"] == 2
    plain = {"name": "x", "forward": 1, "backward": 2, "activation": 1, "params": 1}
    for version in (1, 2):
        assert parse_costs({"version": version, "layers": [plain]}).tp_degrees == (1,)
        with pytest.raises(CostsFileError, match=r"layers\[0\].tp: a version 3 field"):
            parse_costs({"version": version, "layers": [{**plain, "tp": []}]})
    with pytest.raises(CostsFileError, match="tp_link_gbs: a version 3 field"):
        parse_costs({"version": 2, "layers": [plain], "tp_link_gbs": 100})
    bad = {**entry, "degree": 1}
    with pytest.raises(CostsFileError, match=r"tp\[0\].degree: expected an integer >= 2"):
        parse_costs({"version": 3, "layers": [{**plain, "tp": [bad]}]})
    with pytest.raises(CostsFileError, match=r"tp\[0\].source: expected one of measured"):
        parse_costs({"version": 3, "layers": [{**plain, "tp": [{**entry, "source": "guessed"}]}]})
    missing = {k: v for k, v in entry.items() if k != "backward_collective"}
    with pytest.raises(CostsFileError, match=r"tp\[0\].backward_collective: missing"):
        parse_costs({"version": 3, "layers": [{**plain, "tp": [missing]}]})
    with pytest.raises(CostsFileError, match="degree 2 given twice"):
        parse_costs({"version": 3, "layers": [{**plain, "tp": [entry, entry]}]})


def test_a_derived_degree_splits_the_products_and_prices_the_collectives() -> None:
    shape = TpShape(gemm_forward=0.6, split_params=0.9, split_activation=0.5,
                    forward_all_reduce=8e6, backward_all_reduce=4e6, forward_all_gather=2e6)  # fmt: skip
    e = derive(4, forward=1.0, backward_input=1.0, backward_weight=0.8, activation=2.0,
               params=1.0, gradients=0.25, shape=shape, link_gbs=10.0)  # fmt: skip
    assert e.forward == pytest.approx(0.4 + 0.6 / 4)
    assert e.backward_weight == pytest.approx(0.2 + 0.6 / 4)
    assert e.backward == pytest.approx(e.backward_input + e.backward_weight)
    # a ring all-reduce sends 2(t-1)/t of the bytes; an all-gather (t-1)/t
    assert e.forward_collective == pytest.approx((1.5 * 8e6 + 0.75 * 2e6) / 10e9 * 1e3)
    assert e.backward_collective == pytest.approx(1.5 * 4e6 / 10e9 * 1e3)
    assert e.activation == pytest.approx(1.0 + 1.0 / 4) and e.params == pytest.approx(0.1 + 0.9 / 4)
    # the products can take no more than the layer's time
    small = derive(2, forward=0.3, backward_input=0.3, backward_weight=0.3, activation=0,
                   params=0, gradients=None, shape=shape, link_gbs=10.0)  # fmt: skip
    assert small.forward == pytest.approx(0.15)
    with pytest.raises(ValueError, match="--link-gbs must be > 0"):
        derive(2, forward=1, backward_input=1, backward_weight=1, activation=0, params=0,
               gradients=None, shape=shape, link_gbs=0)  # fmt: skip


def test_the_costs_at_a_degree_add_the_collectives_where_they_are_paid() -> None:
    costs = _costs(random.Random(1), 4)
    at = costs.at_tp(2)
    for plain, split in zip(costs.layers, at.layers):
        e = plain.tp[0]
        assert split.forward == pytest.approx(e.forward + e.forward_collective)
        assert split.backward_input == pytest.approx(e.backward_input + e.backward_collective)
        assert split.backward_weight == e.backward_weight and split.params == e.params
    with pytest.raises(
        ValueError, match="gives degrees 1, 2, 4 for every layer; profile with --tp"
    ):
        costs.at_tp(8)


def _exhaustive(costs, cluster, memory_gib, schedules, global_batch):
    """Every shape, by hand: the pipeline search's fitting candidates with each rank's sync."""
    best = None
    for tp in (1, 2, 4):
        for pp in range(1, costs.num_layers + 1):
            if cluster.gpus_per_node % tp or cluster.gpus % (tp * pp):
                continue
            shape = Shape(pp, tp, cluster.gpus // (tp * pp))
            if global_batch % shape.dp:
                continue
            at = shape_costs(costs, shape, "fsdp")
            try:
                found = search(at, num_ranks=pp, memory_gib=memory_gib,
                               microbatches=[global_batch // shape.dp], schedules=schedules)  # fmt: skip
            except ValueError:
                continue
            for c in found.fitting:
                p = c.plan
                program = build_schedule(p.schedule, pp, p.microbatches, p.stages_per_rank)
                step = 0.0
                starts = [0] + [sum(p.stage_layers[: s + 1]) for s in range(len(p.stage_layers))]
                for rank in range(pp):
                    stages = [s for s, r in enumerate(program.placement.rank_of_stage) if r == rank]
                    grads = sum(
                        at.gradient_gib(x)
                        for s in stages
                        for x in at.layers[
                            starts[s % len(p.stage_layers)] : starts[s % len(p.stage_layers) + 1]
                        ]
                    )
                    end = max(s.end for s in c.timeline.spans if s.rank == rank)
                    step = max(step, end + sync_ms(grads, shape, cluster, "fsdp"))
                per = (step - c.timeline.start) / (p.microbatches * shape.dp)
                if best is None or per < best[0] - 1e-12:
                    best = (per, shape)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_the_search_equals_an_exhaustive_one(seed: int) -> None:
    rng = random.Random(seed)
    costs = _costs(rng, rng.choice((4, 5, 6)))
    cluster = Cluster(gpus=8, gpus_per_node=4, link_gbs=rng.choice((5.0, 50.0)), node_link_gbs=2.0)
    memory = rng.uniform(1.5, 4.0)
    schedules = ["1f1b", "zb-h1", "interleaved-1f1b"]
    kwargs = dict(memory_gib=memory, schedules=schedules, global_batch=16, micro_batch_size=1)
    pruned = nd_search(costs, cluster, **kwargs)
    full = nd_search(costs, cluster, exhaustive=True, **kwargs)
    by_hand = _exhaustive(costs, cluster, memory, schedules, 16)
    if by_hand is None:
        assert not full.ranked and not pruned.ranked
        return
    assert pruned.best.to_json() == full.best.to_json()
    two = nd_search(costs, cluster, keep=2, **kwargs)  # what --explain searches
    if full.runner_up is not None:
        assert two.runner_up is not None
        assert two.runner_up.to_json() == full.runner_up.to_json()
    assert pruned.best.shape == by_hand[1]
    assert pruned.best.ms_per_global_microbatch == pytest.approx(by_hand[0], rel=1e-12)
    # the pruned search simulated no more shapes than the exhaustive one
    assert len(pruned.ranked) <= len(full.ranked)
    assert sum(r.simulated for r in pruned.shapes) <= sum(r.simulated for r in full.shapes)


def test_the_plan_carries_tp_and_dp_and_explain_sums_its_parts() -> None:
    costs = _costs(random.Random(3), 6)
    cluster = Cluster(gpus=8, gpus_per_node=8, link_gbs=50.0, node_link_gbs=5.0)
    found = nd_search(costs, cluster, memory_gib=4.0, schedules=["1f1b", "zb-h1"], exhaustive=True)
    best = found.best
    layout = Layout.from_json(best.to_json())
    assert (layout.tp, layout.dp) == (best.shape.tp, best.shape.dp)
    assert layout.num_gpus == 8
    for nd in found.ranked[:3]:
        parts = breakdown(nd, costs)
        assert parts.compute + parts.bubble + parts.sync == pytest.approx(parts.total)
        assert parts.collectives <= parts.compute
        if nd.shape.tp > 1:
            assert parts.collectives > 0
    lines = explain(best, found.runner_up, costs)
    assert "why the pick beat the runner-up" in lines[0]
    assert found.runner_up is not None and best.key() <= found.runner_up.key()


def test_layout_sizes_are_checked_and_old_plans_read_as_one() -> None:
    old = {"schedule": "1f1b", "ranks": 2, "stages_per_rank": 1, "microbatches": 2,
           "stage_layers": [1, 1]}  # fmt: skip
    layout = Layout.from_json(old)
    assert (layout.tp, layout.dp, layout.ep) == (None, None, 1) and layout.num_gpus == 2
    assert "tp" not in layout.to_json()
    assert Layout.from_json({**old, "tp": 2, "dp": 4}).num_gpus == 16
    with pytest.raises(ValueError, match="'tp' must be an integer >= 1"):
        Layout.from_json({**old, "tp": 0})
    with pytest.raises(ValueError, match="expert parallel is not run yet"):
        Layout.from_json({**old, "ep": 2})


def test_a_shape_whose_static_memory_cannot_fit_is_refused_before_simulating() -> None:
    costs = _costs(random.Random(4), 4)
    cluster = Cluster(gpus=4, gpus_per_node=4, link_gbs=50.0, node_link_gbs=5.0)
    found = nd_search(costs, cluster, memory_gib=0.5, schedules=["1f1b"])
    assert all(r.best is None for r in found.shapes)
    assert any("static memory alone" in r.why for r in found.shapes)
    with pytest.raises(ValueError, match="no pp x tp x dp shape has a plan that fits"):
        _ = found.best
    assert all_reduce_ms(1e9, 1, 1.0) == 0.0
