"""A synthesized schedule as a plan: ``Layout`` carries its program (older plans still load),
``pipetrain synthesize --json`` and ``plan --synthesized --json`` write it, ``pipetrain train
--plan`` runs exactly that program (float64, 2 gloo ranks: the same losses and weights as the
program run through ``Pipeline`` directly, and as unsplit training), and ``Pipeline.from_plan``
refuses a program for other ranks and an N-D plan on a mesh of other tp/dp sizes, naming both.
The budget flags of ``plan`` and ``synthesize`` are one declaration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pipetrain.cli import budget_flags, plan_command, synthesize_command
from pipetrain.cli.commands import main
from pipetrain.planner.costs_file import LayerCost, ModelCosts, save_costs
from pipetrain.planner.layout import Layout
from pipetrain.schedule.action import parse_action
from pipetrain.schedule.program import Program
from pipetrain.schedule.program_io import from_csv, program_from_dict, program_to_dict
from pipetrain.schedule.registry import build_schedule

#: the built-in GPT at its smallest: embed, 2 blocks, head (4 layers), in float64
TINY = [
    *("--model", "gpt", "--layers", "2", "--hidden", "16", "--heads", "2", "--seq-len", "8"),
    *("--dtype", "float64", "--microbatch-size", "1", "--timeout", "60"),
]
MICROBATCHES = 4


def heavy_head() -> ModelCosts:
    """The tiny GPT's four layers, the head three times as slow and as large as the others."""
    scale = {"head": 3.0}
    return ModelCosts(
        layers=tuple(
            LayerCost(
                name=name,
                forward=scale.get(name, 1.0),
                backward_input=scale.get(name, 1.0),
                backward_weight=0.8 * scale.get(name, 1.0),
                backward=1.8 * scale.get(name, 1.0),
                activation=scale.get(name, 1.0),
                params=0.0,
            )
            for name in ("embed", "block0", "block1", "head")
        ),
        comm=0.1,
    )


def _synthesized_plan(tmp_path: Path, capsys, memory_gib: str = "5") -> dict:
    costs = tmp_path / "costs.json"
    save_costs(heavy_head(), costs)
    argv = ["synthesize", "--costs", str(costs), "-p", "2", "-m", str(MICROBATCHES)]
    assert main([*argv, "--memory-gib", memory_gib, "--headroom", "0", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_layout_carries_its_program_and_older_plans_still_load(tmp_path, capsys) -> None:
    plan = _synthesized_plan(tmp_path, capsys)
    layout = Layout.from_json(plan)
    assert layout.schedule == "synthesized" and layout.program is not None
    program = layout.program
    assert (program.num_ranks, program.num_stages) == (2, len(plan["stage_layers"]))
    assert layout.pipeline_schedule is program
    assert Layout.from_json(json.loads(json.dumps(layout.to_json()))) == layout
    # the program is none of the families': the planner's pick is the baseline it beat
    base = plan["baseline"]
    family = build_schedule(base["schedule"], 2, MICROBATCHES, base["stages_per_rank"])
    assert program.actions != family.actions
    assert plan["predicted"]["step_ms"] < base["predicted"]["step_ms"]
    # a plan from before programs: no 'program', the family's name to run
    old = {k: v for k, v in base.items() if k not in ("program", "predicted")}
    assert Layout.from_json(old).program is None
    assert Layout.from_json(old).pipeline_schedule == base["schedule"]


def test_a_plans_program_must_be_the_plan_it_sits_in(tmp_path, capsys) -> None:
    plan = _synthesized_plan(tmp_path, capsys)
    other = dataclasses.replace(build_schedule("1f1b", 3, MICROBATCHES), name="synthesized")
    wrong = [
        ({"program": program_to_dict(other)}, r"says 2 ranks, \d+ stages .* runs 3 ranks"),
        ({"microbatches": 8}, "8 micro-batches but its program runs .* 4 micro-batches"),
        ({"schedule": "zbv"}, "'schedule' is 'zbv' but its program is named 'synthesized'"),
        ({"program": {**plan["program"], "actions": [[], []]}}, "'program' cannot run"),
        ({"program": [1, 2]}, "'program' cannot run: program JSON is a list"),
    ]
    for change, message in wrong:
        with pytest.raises(ValueError, match=message):
            Layout.from_json(plan | change)
    # a program whose row runs a forward before its input arrives is refused before any process
    rows = [list(r) for r in plan["program"]["actions"]]
    rows[1] = [a for a in rows[1] if parse_action(a).kind.name != "F"] + [
        a for a in rows[1] if parse_action(a).kind.name == "F"
    ]
    with pytest.raises(ValueError, match="'program' cannot run"):
        Layout.from_json(plan | {"program": {**plan["program"], "actions": rows}})
    uneven = from_csv("0F0,1F0,2F0,2B0,1B0,0B0\n3F0,3B0\n", name="synthesized")
    with pytest.raises(ValueError, match=r"places \[3, 1\] stages on its ranks"):
        Layout.of_program(uneven, (1, 1, 1, 1))
    two_copies = build_schedule("dualpipe", 2, 4)
    with pytest.raises(ValueError, match="2 copies of the model"):
        Layout.of_program(two_copies, (1,) * two_copies.num_stages)


def test_plan_synthesized_json_writes_the_faster_synthesized_plan(tmp_path, capsys) -> None:
    costs = tmp_path / "costs.json"
    save_costs(heavy_head(), costs)
    argv = ["plan", "--costs", str(costs), "-p", "2", "-m", "4", "--memory-gib", "4"]
    argv += ["--headroom", "0", "--synthesized"]
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["schedule"] == "synthesized" and Layout.from_json(plan).program is not None
    assert plan["predicted"]["step_ms"] < plan["baseline"]["predicted"]["step_ms"]
    assert main(argv) == 0
    assert "--json writes the synthesized plan" in capsys.readouterr().out
    # no synthesis asked: the family's pick, as before
    assert main([*argv[:-1], "--json"]) == 0
    assert "program" not in json.loads(capsys.readouterr().out)


def test_plan_synthesized_keeps_an_offloading_pick_it_cannot_synthesize(tmp_path, capsys) -> None:
    """Where only offloading plans fit, the synthesis (which plans no offload) has nothing to
    start from: the pick is printed, and standard error says why nothing was synthesized."""
    block = dict(forward=1.0, backward_input=1.0, backward_weight=1.0, backward=2.0)
    layers = tuple(LayerCost(name=f"l{i}", **block, activation=1.0, params=0.0) for i in range(4))
    costs = tmp_path / "costs.json"
    save_costs(ModelCosts(layers=layers, host_bandwidth_gbs=1e5), costs)
    argv = ["plan", "--costs", str(costs), "-p", "2", "-m", "4", "--memory-gib", "2"]
    assert main([*argv, "--headroom", "0", "--synthesized", "--json"]) == 0
    out, err = capsys.readouterr()
    assert Layout.from_json(json.loads(out)).offloads
    assert "--synthesized: nothing synthesized (no plan fits" in err


def test_plan_and_synthesize_declare_the_budget_once() -> None:
    for options in (plan_command.OPTIONS, synthesize_command.OPTIONS):
        for shared in (budget_flags.COSTS, *budget_flags.BUDGET):
            assert sum(opt is shared for opt in options) == 1
            assert not [o for o in options if o.flags == shared.flags and o is not shared]


@pytest.mark.slow
def test_train_plan_runs_the_synthesized_program_exactly(tmp_path, capsys) -> None:
    pytest.importorskip("torch")
    from runtime_harness import launch

    from pipetrain.app.models.data import make_corpus
    from pipetrain.app.train_checks import check_arguments
    from pipetrain.cli.train_command import config_from_argv

    plan = _synthesized_plan(tmp_path, capsys)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    text = tmp_path / "train.txt"
    text.write_bytes(make_corpus(2048))
    argv = [*TINY, "--plan", str(plan_file), "--data", str(text)]
    layout = check_arguments(config_from_argv(argv))  # what the launcher checks first
    assert layout.program is not None and layout.schedule == "synthesized"
    for rank in launch(2, _train_direct_unsplit, argv, timeout=120):
        assert rank["problems"] == [], "\n".join(rank["problems"])
        assert len(rank["train"]) == 3
        assert (
            "program (synthesized) runs on 3 pipeline ranks but the process group has 2"
            in (rank["refused"]["ranks"])
        )
        assert "plan is for tp 1 × dp 2 but the mesh has tp 1 × dp 1" in rank["refused"]["mesh"]
        assert "plan is for tp 2 × dp 1 but the run has no mesh=" in rank["refused"]["no mesh"]


def _train_direct_unsplit(rank: int, world: int, argv: list[str]) -> dict:
    """3 steps of ``pipetrain train --plan`` (its losses and this rank's weights), the plan's
    program run through ``Pipeline`` directly with the same optimizer, and the unsplit model;
    then ``from_plan``'s refusals."""
    import torch

    import pipetrain
    from pipetrain.app.batch_source import train_batches
    from pipetrain.app.catalog import build
    from pipetrain.app.lr_schedule import parameter_groups
    from pipetrain.app.train import train
    from pipetrain.cli.train_command import config_from_argv

    config = config_from_argv([*argv, "--steps", "3", "--lr", "0.01", "--lr-schedule", "constant"])
    run = train(config, torch.device("cpu"))
    plan = json.loads(Path(argv[argv.index("--plan") + 1]).read_text())
    program, counts = program_from_dict(plan["program"]), plan["stage_layers"]
    model = build(config.shape)
    num_layers = len(model.names)
    stages = pipetrain.split(model.layers, counts, num_layers=num_layers)
    pipe = pipetrain.Pipeline(stages, schedule=program, loss_fn=model.loss_fn, device="cpu")
    layers = [model.layers(i) for i in range(num_layers)]
    direct, unsplit = [], []
    with pipe:
        optimizers = [
            torch.optim.AdamW(parameter_groups(params, 0.0), lr=0.01, betas=(0.9, 0.95))
            for params in (list(pipe.parameters()), [p for m in layers for p in m.parameters()])
        ]
        batches = train_batches(config, model, program.num_microbatches, 0)
        for _ in range(3):
            batch = next(batches)
            for opt in optimizers:
                opt.zero_grad(set_to_none=True)
            direct.append(float(pipe.step(batch.inputs, batch.targets).detach()))
            out = batch.inputs
            for layer in layers:
                out = layer(out)
            loss = model.loss_fn(out, batch.targets)
            loss.backward()
            unsplit.append(float(loss.detach()))
            for opt in optimizers:
                opt.step()
        mine = {}
        for s in sorted(pipe.modules):
            mine.update(pipe.modules[s].state_dict())
    reference = {
        f"layers.{i}.{k}": v
        for i, layer in enumerate(layers)
        for k, v in layer.state_dict().items()
    }
    problems = _differences(run.losses, direct, unsplit, run.state, mine, reference)
    return {"train": run.losses, "problems": problems, "refused": _refusals(model, world)}


def _differences(trained, direct, unsplit, state, mine, reference) -> list[str]:
    import torch

    problems = []
    for name, losses in (("direct Pipeline", direct), ("unsplit", unsplit)):
        if not torch.allclose(torch.tensor(trained), torch.tensor(losses), rtol=1e-10, atol=0):
            problems.append(f"train --plan losses {trained} != {name} {losses}")
    if not state or state.keys() != mine.keys():
        problems.append(f"weights held: train {sorted(state)} vs Pipeline {sorted(mine)}")
    for key, value in state.items():
        for name, other in (("direct Pipeline", mine.get(key)), ("unsplit", reference.get(key))):
            if other is None or not torch.allclose(value, other, rtol=1e-9, atol=1e-12):
                problems.append(f"{key}: train --plan differs from {name}")
    return problems


def _refusals(model, world: int) -> dict[str, str]:
    """``from_plan``'s one-line refusals: a program for 3 ranks on 2, an N-D plan for dp 2 on a
    mesh without dp, one for tp 2 without a mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    import pipetrain

    three = build_schedule("1f1b", 3, MICROBATCHES)
    as_synthesized = Program(three.placement, MICROBATCHES, three.actions, "synthesized")
    family = {"schedule": "1f1b", "ranks": world, "stages_per_rank": 1}
    family |= {"microbatches": MICROBATCHES, "stage_layers": [2, 2]}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    cases = {
        "ranks": (Layout.of_program(as_synthesized, (2, 1, 1)), {}),
        "mesh": (family | {"tp": 1, "dp": 2}, {"mesh": mesh}),
        "no mesh": (family | {"tp": 2, "dp": 1}, {}),
    }
    out = {}
    for name, (plan, options) in cases.items():
        try:
            pipetrain.Pipeline.from_plan(model.layers, plan, model.loss_fn, **options)
        except ValueError as e:
            out[name] = str(e)
        else:
            out[name] = "not refused"
    return out


def test_a_layout_of_a_program_reads_its_shape() -> None:
    program = build_schedule("zbv", 2, MICROBATCHES)
    renamed = dataclasses.replace(program, name="synthesized")
    layout = Layout.of_program(renamed, (1, 1, 1, 1), ("none", "full", "none", "none"))
    assert (layout.ranks, layout.stages_per_rank, layout.microbatches) == (2, 2, MICROBATCHES)
    assert layout.recompute[1] == "full" and layout.pipeline_schedule is renamed
