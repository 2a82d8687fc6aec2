"""``pipetrain plan --gpus``: exactly one of --ranks and --gpus, the N-D pick and its table, its
JSON as ``train --plan`` reads it, --explain; ``train --plan`` holds --tp and --dp to the plan's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.planner.costs_file import LayerCost, ModelCosts, save_costs
from pipetrain.planner.costs_file_tp import TpShape, derive
from pipetrain.planner.layout import Layout


def _costs_file(tmp_path: Path) -> str:
    shape = TpShape(0.6, 0.9, 0.5, 4e6, 4e6)

    def layer(name: str, f: float, params: float) -> LayerCost:
        base = dict(forward=f, backward_input=f, backward_weight=f, activation=0.2, params=params)
        tp = tuple(derive(t, **base, gradients=None, shape=shape, link_gbs=50.0) for t in (2, 4))
        return LayerCost(name=name, backward=2 * f, tp=tp, **base)

    layers = (
        layer("embed", 0.1, 1.0),
        *(layer(f"b{i}", 1.0, 0.5) for i in range(4)),
        layer("head", 2, 1),
    )
    costs = ModelCosts(layers=layers, comm=0.05, tp_link_gbs=50.0,
                       meta={"micro_batch_size": 1, "seq_len": 16})  # fmt: skip
    path = tmp_path / "costs.json"
    save_costs(costs, path)
    return str(path)


def test_give_exactly_one_of_ranks_and_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    costs = _costs_file(tmp_path)
    assert main(["plan", "--costs", costs, "--memory-gib", "4"]) == 2
    assert "give exactly one of --ranks P" in capsys.readouterr().err
    assert main(["plan", "--costs", costs, "--memory-gib", "4", "-p", "2", "--gpus", "8"]) == 2
    assert "give exactly one of --ranks P" in capsys.readouterr().err


def test_plan_gpus_prints_the_pick_each_shape_and_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--costs", _costs_file(tmp_path), "--gpus", "8", "--gpus-per-node", "4",
            "--memory-gib", "3", "--schedules", "1f1b,zb-h1", "--global-batch", "16",
            "--micro-batch-size", "1"]  # fmt: skip
    assert main([*argv, "--explain"]) == 0
    out = capsys.readouterr().out
    assert "best plan of each pp x tp x dp shape:" in out
    assert "tokens/s" in out and "why the pick beat the runner-up" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layout = Layout.from_json(plan)
    assert layout.num_gpus == 8 and layout.microbatches * layout.dp == 16
    assert plan["predicted"]["step_ms"] >= plan["predicted"]["pipeline_ms"]
    # a tensor-parallel group never leaves its node: with 2 GPUs a node, tp 4 is not tried
    assert main([*argv[:5], "--gpus-per-node", "2", *argv[7:], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tp"] <= 2


def test_plan_ranks_explains_against_the_next_family(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--costs", _costs_file(tmp_path), "-p", "2", "--memory-gib", "4",
            "--schedules", "1f1b,zb-h1", "--explain"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "why the pick beat the runner-up" in out and "pp 2 x tp 1 x dp 1" in out


def test_train_plan_refuses_other_tp_and_dp(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from pipetrain.app.train_checks import check_arguments
    from pipetrain.cli.train_command import config_from_argv

    plan = {"schedule": "1f1b", "ranks": 2, "stages_per_rank": 1, "microbatches": 4,
            "stage_layers": [3, 3], "tp": 1, "dp": 2}  # fmt: skip
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    gpt = ["--model", "gpt", "--layers", "4", "--plan", str(path)]
    with pytest.raises(ValueError, match="planned for --tp 1 --dp 2, not --tp 1 --dp 1"):
        check_arguments(config_from_argv(gpt))
    layout = check_arguments(config_from_argv([*gpt, "--dp", "2"]))
    assert (layout.tp, layout.dp) == (1, 2)
    del plan["tp"], plan["dp"]  # a pipeline-only plan leaves the sizes to the run
    path.write_text(json.dumps(plan))
    assert check_arguments(config_from_argv([*gpt, "--dp", "2"])).dp is None


TINY_GPT = ["--model", "gpt", "--layers", "1", "--hidden", "8", "--heads", "2", "--vocab", "32"]


def test_profile_tp_derives_each_degree_from_the_measured_layer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The degree-1 profile stands in (timing it is the profiler's own tests' business); the
    tensor-parallel entries are measured from the real layers."""
    pytest.importorskip("torch")
    from pipetrain.planner.costs_file import load_costs
    from pipetrain.runtime.profile import profile_layers

    def degree_one(layers, *_, names=None, meta=None, **__) -> ModelCosts:
        one = dict(forward=1.0, backward_input=1.0, backward_weight=1.0, backward=2.0)
        return ModelCosts(
            layers=tuple(LayerCost(name=n, activation=1.0, params=1.0, **one) for n in names or ()),
            meta={**(meta or {}), "device": "cpu", "optimizer": "adamw"},
        )

    monkeypatch.setattr(profile_layers, "profile", degree_one)
    out = tmp_path / "costs.json"
    argv = ["profile", *TINY_GPT, "--seq-len", "4", "--microbatch-size", "2", "--repeats", "1",
            "--device", "cpu", "--tp", "1,2,4", "--link-gbs", "10", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    costs = load_costs(out)
    assert json.loads(out.read_text())["version"] == 3
    assert costs.tp_degrees == (1, 2, 4) and costs.tp_link_gbs == 10
    embed, block, head = costs.layers
    assert all(e.source == "derived" for x in costs.layers for e in x.tp)
    hidden_bytes = 2 * 4 * 8 * 4  # rows x tokens x hidden x float32
    for e in block.tp:  # attention's and the MLP's regions: two all-reduces each way
        ring = 2 * (e.degree - 1) / e.degree
        assert e.forward_collective == pytest.approx(ring * 2 * hidden_bytes / 10e9 * 1e3)
        assert e.backward_collective == pytest.approx(e.forward_collective)
        assert 1.0 / e.degree <= e.forward < 1.0 and 1.0 / e.degree < e.params < 1.0
        assert 1.0 / e.degree < e.activation < 1.0  # heads split, the residual stream whole
    # the head gathers its logits (vocab 32 wide); the embedding all-reduces its output
    logits = 2 * 4 * 32 * 4
    assert head.tp[0].forward_collective == pytest.approx(0.5 * logits / 10e9 * 1e3)
    assert embed.tp[0].forward_collective == pytest.approx(hidden_bytes / 10e9 * 1e3)
    assert embed.tp[0].backward_collective == 0
    # the N-D planner reads it
    plan = ["plan", "--costs", str(out), "--gpus", "4", "--memory-gib", "100", "--json"]
    assert main(plan) == 0


def test_plan_shows_a_synthesized_schedule_beside_the_pick(tmp_path, capsys):
    """``--synthesized`` adds the synthesis under the same budget; with ``--gpus`` it is refused."""
    costs = (
        Path(__file__).parents[2]
        / "docs/results/h200x2-2026-11-28-plan-cuda-graph-sustained3/costs.json"
    )
    assert (
        main(["plan", "--costs", str(costs), "--ranks", "4", "--memory-gib", "7", "--synthesized"])
        == 0
    )
    out = capsys.readouterr().out
    assert "synthesized: 4 ranks" in out and "planner's pick:" in out
    argv = [
        "plan",
        "--costs",
        str(costs),
        "--gpus",
        "8",
        "--gpus-per-node",
        "8",
        "--memory-gib",
        "7",
    ]
    assert main([*argv, "--synthesized"]) == 2
    assert "--synthesized plans the pipeline alone" in capsys.readouterr().err
