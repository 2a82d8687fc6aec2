"""Recompute in the planner: the costs file's version 2, the per-layer model, the search that
turns recompute on only when nothing fits without it, and plans that carry it (pure Python)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipetrain.cli import main
from pipetrain.planner import Layout, ModelCosts, NoPlanFits, parse_costs, plan, search
from pipetrain.planner.costs_file import VERSION, LayerCost, load_costs, save_costs
from pipetrain.planner.recompute import (
    INPUT_SHARE,
    SELECTIVE_KEPT,
    SELECTIVE_TIME,
    layers_under,
    recomputed_layer,
)
from pipetrain.planner.recompute_modes import Recompute, describe, stage_recompute
from pipetrain.planner.search import simulate_plan, stage_costs
from pipetrain.schedule.action import OpKind
from pipetrain.schedule.registry import build_schedule


def block(name: str, act: float = 1.0, kept: float | None = 0.05, params: float = 0.1):
    return LayerCost(
        name=name, forward=1.0, backward_input=1.0, backward_weight=1.0, backward=2.0,
        activation=act, params=params, recompute=0.8, recompute_activation=kept,
    )  # fmt: skip


def heavy(num_layers: int = 8) -> ModelCosts:
    """Activations dominate memory: the shape where recompute decides what fits."""
    return ModelCosts(layers=tuple(block(f"l{i}") for i in range(num_layers)))


def test_version_2_round_trips_and_version_1_loads_with_defaults(tmp_path) -> None:
    a = dataclasses.replace(block("a"), selective_activation=0.5, selective_recompute=0.3)
    costs = ModelCosts(layers=(a, block("b", kept=None)), host_bandwidth_gbs=25.0)
    path = tmp_path / "costs.json"
    save_costs(costs, path)
    data = json.loads(path.read_text())
    assert data["version"] == VERSION == 3 and data["host_bandwidth_gbs"] == 25.0
    assert data["layers"][0]["recompute"] == 0.8
    assert data["layers"][0]["recompute_activation"] == 0.05
    assert data["layers"][0]["selective_activation"] == 0.5
    assert "recompute_activation" not in data["layers"][1]
    assert load_costs(path) == costs
    old = parse_costs(
        {"version": 1, "layers": [{"forward": 2, "backward": 3, "activation": 1, "params": 0}]}
    )
    (layer,) = old.layers
    assert layer.recompute is None and layer.recompute_ms == 2.0
    assert layer.recompute_activation is None and old.host_bandwidth_gbs is None
    with pytest.raises(ValueError, match=r"host_bandwidth_gbs: a version 2 field"):
        parse_costs({**data, "version": 1})
    data.pop("host_bandwidth_gbs")
    with pytest.raises(ValueError, match=r"layers\[0\].recompute: a version 2 field"):
        parse_costs({**data, "version": 1})
    with pytest.raises(ValueError, match=r"host_bandwidth_gbs: expected a finite number"):
        parse_costs({**data, "host_bandwidth_gbs": -1})


def test_the_optimizers_update_can_set_a_ranks_peak() -> None:
    """After the step no activation is held, but AdamW's update allocates a parameter-sized
    temporary beside parameters, gradients and states: where recompute leaves little held, that
    is the rank's peak (measured on GPUs: docs/planning.md), and the planner budgets for it."""
    update = dataclasses.replace(block("x", params=4.0), optimizer_workspace=1.0)
    costs = ModelCosts(layers=(update,) * 4)
    data = costs.to_json()
    assert data["layers"][0]["optimizer_workspace"] == 1.0 and parse_costs(data) == costs
    one = {"forward": 1, "backward": 2, "activation": 1, "params": 4, "optimizer_workspace": 1}
    with pytest.raises(ValueError, match=r"layers\[0\].optimizer_workspace: a version 2 field"):
        parse_costs({"version": 1, "layers": [one]})
    program = build_schedule("1f1b", 2, 4)
    _, peaks = simulate_plan(costs, program, (2, 2), ("full", "full"))
    assert peaks == pytest.approx((8.0 + 2.0, 8.0 + 2.0))  # static + both layers' updates
    _, plain = simulate_plan(costs, program, (2, 2))
    without = ModelCosts(layers=(block("x", params=4.0),) * 4)
    _, held = simulate_plan(without, program, (2, 2))
    assert plain == pytest.approx(held)  # the step's activations (> 2 GiB) set these peaks
    found = search(costs, num_ranks=2, memory_gib=9.5, headroom=0, schedules=["1f1b"])
    with pytest.raises(NoPlanFits):
        found.best  # noqa: B018 - full recompute would fit but for the update
    assert search(without, num_ranks=2, memory_gib=9.5, headroom=0, schedules=["1f1b"]).best


def test_the_layer_model_of_full_and_selective_recompute() -> None:
    layer = block("x", act=1.0, kept=0.1)
    full = recomputed_layer(layer, Recompute.FULL)
    assert full.activation == 0.1  # what a checkpointed layer keeps, as measured
    # the runtime runs a recomputing stage's backward whole in I (graph replay), W nothing
    assert full.backward == 2.8 and full.backward_input == 2.8 and full.backward_weight == 0.0
    assert full.workspace == pytest.approx(0.9)  # live again while it is recomputed
    assert full.activation_for_weight == 0.0  # nothing waits for W
    selective = recomputed_layer(layer, Recompute.SELECTIVE)
    assert selective.activation == pytest.approx(0.1 + 0.9 * SELECTIVE_KEPT)
    assert selective.backward == pytest.approx(2.0 + 0.8 * SELECTIVE_TIME)
    assert recomputed_layer(layer, Recompute.NONE) is layer
    unmeasured = recomputed_layer(block("y", act=2.0, kept=None), Recompute.FULL)
    assert unmeasured.activation == pytest.approx(2.0 * INPUT_SHARE)
    measured = dataclasses.replace(layer, selective_activation=0.4, selective_recompute=0.5)
    assert recomputed_layer(measured, Recompute.SELECTIVE).activation == 0.4
    assert recomputed_layer(measured, Recompute.SELECTIVE).backward == 2.5  # as measured


def test_a_captured_step_splits_a_recomputing_stages_backward() -> None:
    """In a step captured as a CUDA graph the runtime defers a recomputing stage's linears, so
    the planner prices its ``I`` as the layer's plus the recompute and leaves its ``W`` to fill
    bubbles: a zero-bubble schedule then predicts a shorter step than with the backward whole."""
    layer = block("x", act=1.0, kept=0.1)
    split = recomputed_layer(layer, Recompute.FULL, split=True)
    assert split.backward_input == pytest.approx(1.8) and split.backward_weight == 1.0
    assert split.backward == pytest.approx(2.8) and split.activation == 0.1
    eager, captured = heavy(8), heavy(8).for_captured_step()
    assert captured.captured and not eager.captured
    mixed = layers_under(captured.layers[:2], stage_recompute("full:1"), 0, 8, split=True)
    assert mixed[1] == captured.layers[1]  # a plain layer beside it splits as it would alone
    program = build_schedule("zb-h1", 2, 8)
    whole, _ = simulate_plan(eager, program, (4, 4), ("full", "full"))
    deferred, _ = simulate_plan(captured, program, (4, 4), ("full", "full"))
    assert deferred.makespan < whole.makespan
    w = [s for s in deferred.spans if s.action.kind is OpKind.W]
    assert w and all(s.end - s.start == pytest.approx(4.0) for s in w)
    with pytest.raises(ValueError, match="no host times"):
        hosted = dataclasses.replace(layer, host_forward=1.0, host_backward=1.0,
                                     host_backward_input=1.0, host_backward_weight=1.0,
                                     device_forward=1.0, device_backward=1.0,
                                     device_backward_input=1.0, device_backward_weight=1.0)  # fmt: skip
        ModelCosts(layers=(hosted,), captured=True)


def test_selective_recompute_that_holds_more_is_priced_as_measured() -> None:
    """Where a layer's logits are cast by the loss, selective recompute caches the matrix
    product's output beside what the loss saves of it, so it holds more than the plain layer
    (measured on GPUs: docs/planning.md). The planner prices what the runtime holds, and the
    runtime leaves the model's last layer (the one feeding the loss) plain under selective
    recompute, so there the planner prices the plain layer."""
    head = dataclasses.replace(block("head", act=1.0, kept=0.99), selective_activation=1.5)
    priced = recomputed_layer(head, Recompute.SELECTIVE)
    assert priced.activation == 1.5 and priced.workspace == head.workspace
    costs = ModelCosts(layers=(*heavy(3).layers, head))
    block_then_head = layers_under(costs.layers[2:], Recompute.SELECTIVE, 2, 4)
    assert block_then_head[1].activation == 1.0  # the head as without recompute,
    assert block_then_head[1].backward_weight == 0.0  # its backward whole in I with the stage's
    assert layers_under(costs.layers[3:], Recompute.SELECTIVE, 3, 4) == [head]  # alone: plain
    assert layers_under(costs.layers[2:], Recompute.FULL, 2, 4)[1].activation == 0.99
    program = build_schedule("1f1b", 2, 4)
    _, plain = simulate_plan(costs, program, (2, 2))
    _, selective = simulate_plan(costs, program, (2, 2), ("none", "selective"))
    assert selective[1] < plain[1]  # the block frees, the head holds what it held


def test_a_recomputing_stage_pays_before_its_backward_and_holds_less() -> None:
    costs = heavy(4)
    program = build_schedule("1f1b", 2, 4)
    sc = stage_costs(costs, program, (2, 2), ("full", "none"))
    assert sc.backward == [2 * 2.8, 2 * 2.0] and sc.activation == pytest.approx([0.1, 2.0])
    timeline, peaks = simulate_plan(costs, program, (2, 2), ("full", "none"))
    b0 = [s.end - s.start for s in timeline.spans if s.action.kind is OpKind.B and s.rank == 0]
    assert b0 == [pytest.approx(5.6)] * 4
    _, plain = simulate_plan(costs, program, (2, 2))
    # rank 0 holds two micro-batches at its peak under 1F1B, and one layer's recompute
    assert plain[0] == pytest.approx(0.2 + 2 * 2.0)
    assert peaks[0] == pytest.approx(0.2 + 2 * 0.1 + 0.95) and peaks[1] == plain[1]


def test_recompute_only_when_nothing_fits_without_it() -> None:
    roomy = search(heavy(), num_ranks=2, memory_gib=100, headroom=0)
    assert not roomy.recompute_tried and roomy.best.plan.recompute == ("none",) * len(
        roomy.best.plan.stage_layers
    )
    lowest_plain = min(max(c.plan.peak_gib) for c in roomy.candidates)
    budget = lowest_plain * 0.5
    tight = search(heavy(), num_ranks=2, memory_gib=budget, headroom=0)
    pick = tight.best.plan
    assert tight.recompute_tried and pick.fits and pick.layout.recomputes
    assert max(pick.peak_gib) <= budget
    assert pick.ms_per_microbatch >= roomy.best.plan.ms_per_microbatch
    assert pick.ms_per_microbatch == min(c.plan.ms_per_microbatch for c in tight.fitting)
    # the raising pass found a mix cheaper than recomputing every stage fully
    all_full = [c for c in tight.fitting if set(c.plan.recompute) == {"full"}]
    assert all_full and pick.ms_per_microbatch < min(c.plan.ms_per_microbatch for c in all_full)


def test_nothing_fits_even_with_full_recompute_names_the_gib() -> None:
    with pytest.raises(NoPlanFits, match=r"even with full recompute on every stage: the smallest "
                       r"peak any candidate reached is [\d.]+ GiB"):  # fmt: skip
        plan(heavy(), num_ranks=2, memory_gib=0.5, headroom=0)


def test_a_stage_without_parameters_never_recomputes() -> None:
    layers = (block("a"), block("free", params=0.0), block("b"), block("c"))
    costs = ModelCosts(layers=layers)
    found = search(costs, num_ranks=4, memory_gib=1.3, headroom=0, schedules=["1f1b"])
    assert found.recompute_tried
    for c in found.candidates:
        if c.plan.stage_layers == (1, 1, 1, 1):
            assert c.plan.recompute[1] == "none", c.plan.recompute


@settings(max_examples=15, deadline=None)
@given(
    acts=st.lists(st.floats(0.1, 2.0), min_size=3, max_size=6),
    squeeze=st.floats(0.2, 1.0),
)
def test_a_pick_fits_and_names_a_mode_per_stage(acts, squeeze) -> None:
    costs = ModelCosts(layers=tuple(block(f"l{i}", act=a) for i, a in enumerate(acts)))
    roomy = search(costs, num_ranks=2, memory_gib=1e6, headroom=0, schedules=["1f1b", "zb-h1"])
    budget = min(max(c.plan.peak_gib) for c in roomy.candidates) * squeeze
    try:
        pick = plan(costs, num_ranks=2, memory_gib=budget, headroom=0, schedules=["1f1b", "zb-h1"])
    except NoPlanFits as e:
        assert "GiB" in str(e)
        return
    assert max(pick.peak_gib) <= budget * (1 + 1e-12)
    assert len(pick.recompute) == len(pick.stage_layers) and sum(pick.stage_layers) == len(acts)


def test_layouts_carry_recompute_and_offload() -> None:
    old = {"schedule": "1f1b", "ranks": 2, "stages_per_rank": 1, "microbatches": 4,
           "stage_layers": [3, 3]}  # fmt: skip
    assert Layout.from_json(old).recompute == ("none", "none")
    new = Layout.from_json({**old, "recompute": ["full", "selective"]})
    assert new.recompute == ("full", "selective") and new.recomputes
    assert Layout.from_json(new.to_json()) == new
    assert Layout.from_json({**old, "offload": [0, 0.0]}).recompute == ("none", "none")
    assert Layout.from_json(old).offload == (0.0, 0.0) and not Layout.from_json(old).offloads
    offloading = Layout.from_json({**old, "offload": [0.5, 0]})
    assert offloading.offload == (0.5, 0.0) and offloading.offloads
    assert Layout.from_json(offloading.to_json()) == offloading
    bad = {
        "recompute": (["full"], "has 1 entries but the plan has 2 stages"),
        "recompute ": (["full", "most"], "unknown recompute mode 'most'; legal: 'none', "),
        "offload": ([0.5], "give one per stage"),
        "offload ": ([1.5, 0], r"offload fraction of stage 0 must be a number in \[0, 1\]"),
        "offload  ": ("half", r"one fraction in \[0, 1\] per stage"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            Layout.from_json({**old, key.strip(): value})
    with pytest.raises(ValueError, match="unknown recompute mode"):
        Layout(schedule="1f1b", ranks=1, stages_per_rank=1, microbatches=1, stage_layers=(2,),
               recompute=("some",))  # fmt: skip


def test_a_stage_may_recompute_only_its_first_k_layers() -> None:
    """``"full:K"`` / ``"selective:K"``: the stage's first K layers recompute, the others hold
    what they held, their backward run whole in ``I`` beside the recomputing ones (the runtime
    does not split a recomputing stage's backward); K is checked against the stage's layers."""
    old = {"schedule": "1f1b", "ranks": 2, "stages_per_rank": 1, "microbatches": 4,
           "stage_layers": [3, 3]}  # fmt: skip
    layout = Layout.from_json({**old, "recompute": ["full:2", "selective:3"]})
    assert layout.recompute == ("full:2", "selective")  # K = the stage's layers: all of them
    assert Layout.from_json(layout.to_json()) == layout and layout.recomputes
    assert describe(layout.recompute) == "f2,s" and describe(["none", "none"]) == "none"
    bad = {
        "full:4": "stage 0: recompute 'full:4' names 4 layers of a stage that holds 3; K is "
        "from 1 to 3",
        "full:0": "stage 0: unknown recompute mode 'full:0'; legal: 'none', 'selective', 'full', "
        "'whole' \\(the stage recomputed as one region\\), or 'selective:K' / 'full:K'",
        "none:1": "unknown recompute mode 'none:1'",
        "full:two": "unknown recompute mode 'full:two'",
    }
    for value, message in bad.items():
        with pytest.raises(ValueError, match=message):
            Layout.from_json({**old, "recompute": [value, "none"]})
    costs = heavy(4)
    under = layers_under(costs.layers[:3], stage_recompute("full:2"), 0, 4)
    assert [x.activation for x in under] == [0.05, 0.05, 1.0]
    assert under[2].backward_input == 2.0 and under[2].backward_weight == 0.0
    assert under[0].backward == pytest.approx(2.8)  # the recompute, paid where it runs
    # selective on the model's last layer stays plain, also when K reaches it
    assert layers_under(costs.layers[2:], stage_recompute("selective:2"), 2, 4)[1].activation == 1.0
    program = build_schedule("1f1b", 2, 4)
    peaks = {m: simulate_plan(costs, program, (2, 2), (m, "none"))[1][0]
             for m in ("none", "full:1", "full")}  # fmt: skip
    assert peaks["none"] > peaks["full:1"] > peaks["full"]


def test_the_search_recomputes_only_as_many_layers_as_memory_asks() -> None:
    """Where recomputing a few of a stage's layers brings its rank within budget, the pick
    recomputes those and no more (Megatron-LM's ``recompute_num_layers``), faster than every
    plan recomputing whole stages."""
    costs = heavy(8)
    roomy = search(costs, num_ranks=2, memory_gib=100, headroom=0, schedules=["1f1b"])
    lowest_plain = min(max(c.plan.peak_gib) for c in roomy.candidates)
    for squeeze in (0.9, 0.7, 0.5):
        found = search(costs, num_ranks=2, memory_gib=lowest_plain * squeeze, headroom=0,
                       schedules=["1f1b"])  # fmt: skip
        pick = found.best.plan
        assert pick.fits and any(":" in m for m in pick.recompute), (squeeze, pick.recompute)
        whole = [c for c in found.fitting if not any(":" in m for m in c.plan.recompute)]
        assert whole and pick.ms_per_microbatch < min(c.plan.ms_per_microbatch for c in whole)


def test_cli_plan_prints_recompute_and_memory_per_rank(tmp_path, capsys) -> None:
    path = tmp_path / "costs.json"
    save_costs(heavy(), path)
    argv = ["plan", "--costs", str(path), "--ranks", "2", "--memory-gib", "3", "--headroom", "0"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["recompute"]) == len(out["stage_layers"]) and "full" in out["recompute"]
    assert max(out["predicted"]["peak_gib"]) <= 3
    svg = tmp_path / "plan.svg"
    assert main([*argv, "--svg", str(svg), "--width", "80"]) == 0
    text = capsys.readouterr().out
    assert "no plan fits without recompute: recompute per stage ['full'" in text
    assert "memory per rank (static + held; █ = 3 GiB, the limit):" in text
    rows = [line for line in text.splitlines() if line.startswith("rank 0 |")]
    assert len(rows) >= 2 and len(rows[-1]) == 80  # the timeline's row, then memory's
    assert "recompute" in text.split("best plan of each family:")[1].splitlines()[1]
    drawn = svg.read_text()
    assert drawn.count('class="mem"') >= 2 and 'class="limit"' in drawn
    assert main([*argv[:-3], "0.5", "--headroom", "0"]) == 2
    assert "even with full recompute on every stage" in capsys.readouterr().err


@settings(max_examples=40, deadline=None)
@given(
    acts=st.lists(st.floats(0.05, 2.0), min_size=1, max_size=8),
    kept=st.floats(0.0, 0.2),
    mode=st.sampled_from([Recompute.FULL, Recompute.SELECTIVE]),
    last=st.booleans(),
)
def test_a_stage_holds_less_the_more_of_its_first_layers_recompute(acts, kept, mode, last):
    """What the search's bisection over K relies on: a stage's held activation never grows as
    K grows, K = 0 holds what no recompute holds and K = all what the whole-stage mode holds; the
    model's last layer stays plain under selective recompute whatever K says."""
    layers = [block(f"l{i}", act=a, kept=min(kept, a)) for i, a in enumerate(acts)]
    n = len(layers) + (0 if last else 1)  # the stage ends the model, or a layer follows it

    def held(spec) -> float:
        return sum(x.activation for x in layers_under(layers, spec, 0, n))

    series = [held(Recompute.NONE)]
    series += [
        held(stage_recompute(f"{mode.value}:{k}", len(layers))) for k in range(1, len(layers) + 1)
    ]
    assert all(b <= a + 1e-12 for a, b in itertools.pairwise(series))
    assert series[-1] == pytest.approx(held(mode))
    if last and mode is Recompute.SELECTIVE:  # held as plain, whatever K says
        under = layers_under(layers, stage_recompute(f"selective:{len(layers)}"), 0, n)
        assert under[-1].activation == layers[-1].activation


def test_cli_plan_names_the_layers_a_partial_recompute_covers(tmp_path, capsys) -> None:
    path = tmp_path / "costs.json"
    save_costs(heavy(), path)
    argv = ["plan", "--costs", str(path), "--ranks", "2", "--memory-gib", "5", "--headroom", "0",
            "--schedules", "1f1b"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "recompute per stage ['full:2', 'none']" in text
    assert "stages: 0: l0..l3 (full: l0..l1); 1: l4..l7" in text
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recompute"] == ["full:2", "none"]


def test_a_stage_recomputed_as_a_whole_holds_its_input_and_splits_as_plain() -> None:
    """``"whole"``: between ``F`` and its backward a micro-batch holds the stage's input only;
    ``I`` pays every layer's recompute and holds the stage's whole activation while it runs;
    ``W`` stays the plain layers' (the backward splits as without recompute), so a zero-bubble
    schedule keeps its ``W`` to fill bubbles, unlike full recompute's whole backward in ``I``."""
    costs = heavy(4)
    program = build_schedule("zb-h1", 2, 4)
    sc = stage_costs(costs, program, (2, 2), ("whole", "none"))
    assert sc.activation == pytest.approx([0.05, 2.0])  # the first layer's input
    assert sc.backward_input == pytest.approx([2 * 2.0, 2.0])  # + each layer's forward again
    assert sc.backward_weight == pytest.approx([2.0, 2.0])
    assert sc.activation_for_weight == pytest.approx([2.0, 2.0])
    assert sc.workspace[0] == pytest.approx(2.0 - 0.05)  # the recompute: the whole activation
    # a last layer's temporaries (a head's logits) come while the recomputed layers before it
    # still hold theirs: the stage's backward peak is both, not the larger
    head = dataclasses.replace(block("head"), workspace=1.5)
    ending = ModelCosts(layers=(block("a"), block("b"), block("c"), head))
    plain_ends = stage_costs(ending, program, (2, 2))
    whole_ends = stage_costs(ending, program, (2, 2), ("none", "whole"))
    assert plain_ends.workspace[1] == pytest.approx(1.5)
    assert whole_ends.workspace[1] == pytest.approx(2.0 - 0.05 + 1.5)
    assert whole_ends.weight_workspace[1] == plain_ends.weight_workspace[1] == pytest.approx(1.5)
    one_f_one_b = build_schedule("1f1b", 2, 4)  # no W: what F to B holds is the peak
    _, plain = simulate_plan(costs, one_f_one_b, (2, 2))
    _, whole = simulate_plan(costs, one_f_one_b, (2, 2), ("whole", "none"))
    # two micro-batches in flight hold their inputs, the recomputed one its whole activation
    assert plain[0] == pytest.approx(0.2 + 2 * 2.0)
    assert whole[0] == pytest.approx(0.2 + 2 * 0.05 + (2.0 - 0.05))
    full, _ = simulate_plan(costs, program, (2, 2), ("full", "full"))
    as_whole, _ = simulate_plan(costs, program, (2, 2), ("whole", "whole"))
    assert as_whole.makespan < full.makespan  # W still fills the bubbles
    assert describe(["whole", "none"]) == "w,-"
    with pytest.raises(ValueError, match="unknown recompute mode 'whole:1'"):
        stage_recompute("whole:1")
    with pytest.raises(ValueError, match="captured step"):
        simulate_plan(costs.for_captured_step(), program, (2, 2), ("whole", "none"))
    base = dict(schedule="zb-h1", ranks=2, stages_per_rank=1, microbatches=4, stage_layers=(2, 2))
    assert Layout(**base, recompute=("whole", "none")).recompute == ("whole", "none")
    with pytest.raises(ValueError, match="recompute 'whole' and offload"):
        Layout(**base, recompute=("whole", "none"), offload=(0.5, 0.0))


def test_an_eager_search_recomputes_whole_stages_where_checkpointing_costs_more() -> None:
    """Where a layer's checkpointed recompute costs far more than its plain forward (an eager
    step, the checkpoint's bookkeeping on the host), a search that must recompute picks stages
    recomputed as a whole, which pay the plain forward, over checkpointing some of their
    layers; a captured step (no random state to restore) never plans them."""
    costs = ModelCosts(layers=tuple(
        dataclasses.replace(block(f"l{i}"), recompute=3.0, selective_recompute=2.5)
        for i in range(8)
    ))  # fmt: skip
    roomy = search(costs, num_ranks=2, memory_gib=100, headroom=0, schedules=["1f1b"])
    lowest_plain = min(max(c.plan.peak_gib) for c in roomy.candidates)
    found = search(costs, num_ranks=2, memory_gib=lowest_plain * 0.8, headroom=0,
                   schedules=["1f1b"])  # fmt: skip
    pick = found.best.plan
    assert pick.fits and "whole" in pick.recompute, pick.recompute
    as_full = [c for c in found.fitting if "whole" not in c.plan.recompute]
    assert as_full and pick.ms_per_microbatch < min(c.plan.ms_per_microbatch for c in as_full)
    captured = search(costs.for_captured_step(), num_ranks=2, memory_gib=lowest_plain * 0.8,
                      headroom=0, schedules=["1f1b"])  # fmt: skip
    assert captured.fitting
    assert not any("whole" in c.plan.recompute for c in captured.candidates)
