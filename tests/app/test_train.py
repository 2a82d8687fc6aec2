"""The training app: the GPT split, the dataset, argument checks, measured costs, and a smoke run.

The smoke run launches ``python -m pipetrain train`` (2 gloo processes on CPU) and is the only
test here that starts processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipetrain.app.config import TrainConfig  # noqa: E402
from pipetrain.app.models import (  # noqa: E402
    GPTConfig,
    batches,
    build_gpt,
    corpus_tensor,
    lm_loss,
    make_corpus,
    make_stage,
    split_gpt,
    stage_layers,
)
from pipetrain.app.train_checks import check_arguments  # noqa: E402
from pipetrain.cli.train_command import config_from_argv  # noqa: E402
from pipetrain.schedule.registry import build_schedule  # noqa: E402
from pipetrain.sim.costs import Costs, measured_costs  # noqa: E402
from pipetrain.sim.simulate import simulate  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = GPTConfig(num_layers=6, hidden=32, num_heads=4, seq_len=16)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4, 6])
def test_split_composes_to_the_unsplit_model_in_float64(num_stages: int) -> None:
    full = build_gpt(TINY, seed=3).double()
    stages = [s.double() for s in split_gpt(TINY, num_stages, seed=3)]
    tokens = torch.randint(
        0, TINY.vocab_size, (2, TINY.seq_len), generator=torch.Generator().manual_seed(0)
    )
    x = tokens
    for stage in stages:
        x = stage(x)
    assert x.dtype == torch.float64 and x.shape == (2, TINY.seq_len, TINY.vocab_size)
    torch.testing.assert_close(x, full(tokens), rtol=1e-12, atol=1e-12)
    # every parameter exactly once, under the same name as in the unsplit model
    merged: dict[str, torch.Tensor] = {}
    for stage in stages:
        for name, p in stage.state_dict().items():
            assert name not in merged, f"{name} held by two stages"
            merged[name] = p
    reference = full.state_dict()
    assert merged.keys() == reference.keys()
    for name, p in reference.items():
        assert torch.equal(merged[name], p), name


def test_stage_layers_are_balanced_and_cover_every_layer() -> None:
    for layers in range(1, 13):
        for n in range(1, layers + 1):
            bounds = stage_layers(layers, n)
            assert [a for a, _ in bounds] == [0, *[b for _, b in bounds[:-1]]]
            assert bounds[-1][1] == layers
            sizes = [b - a for a, b in bounds]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
            if n > 2 and len(set(sizes)) > 1:  # leftovers go to the middle stages first
                assert sizes[0] <= max(sizes[1:-1]) and sizes[-1] <= max(sizes[1:-1])
    assert [b - a for a, b in stage_layers(10, 4)] == [2, 3, 3, 2]


def test_split_refuses_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        split_gpt(TINY, TINY.num_layers + 1)
    with pytest.raises(ValueError, match="stage_index"):
        make_stage(TINY, 6, 6)
    with pytest.raises(ValueError, match="multiple of num_heads"):
        GPTConfig(hidden=30, num_heads=4)


def test_only_first_and_last_stage_hold_embedding_and_head() -> None:
    stages = split_gpt(TINY, 3)
    assert hasattr(stages[0], "tok_emb") and not hasattr(stages[0], "head")
    assert not hasattr(stages[1], "tok_emb") and not hasattr(stages[1], "head")
    assert hasattr(stages[2], "head") and not hasattr(stages[2], "tok_emb")


def test_dataset_is_deterministic_bytes_and_batches_shift_by_one() -> None:
    assert make_corpus(1000, seed=1) == make_corpus(1000, seed=1)
    assert make_corpus(1000, seed=1) != make_corpus(1000, seed=2)
    tokens = corpus_tensor(4096)
    assert tokens.dtype == torch.int64 and 0 <= int(tokens.min()) and int(tokens.max()) < 256
    a = next(batches(tokens, 3, 8, seed=5))
    b = next(batches(tokens, 3, 8, seed=5))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    inputs, targets = a
    assert inputs.shape == targets.shape == (3, 8)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])


def test_loss_goes_down_on_one_process() -> None:
    torch.manual_seed(0)
    model = build_gpt(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = batches(corpus_tensor(1 << 14), 8, TINY.seq_len)
    losses = []
    for _ in range(30):
        x, y = next(data)
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def _args(*argv: str) -> TrainConfig:
    return config_from_argv(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--schedule", "nope"), "legal schedules"),
        (("--schedule", "dualpipev", "--microbatches", "2"), "num_microbatches"),
        (("--schedule", "zbv", "-p", "4", "--layers", "1"), "--layers >= 5"),
        (("--hidden", "30"), "multiple of --heads"),
        (("--heads", "4", "--kv-heads", "3"), "multiple of --kv-heads"),
        (("--schedule", "1f1b", "--stages-per-rank", "2"), "stages_per_rank"),
        (("--model", "gpt", "--tie-embeddings"), "Hugging Face models"),
        (("--vocab", "100"), "must be >= 256"),
        (("--text", "/no/such/file"), "no such file"),
        (("--resume",), "needs --checkpoint-dir"),
        (("--checkpoint-every", "5"), "needs --checkpoint-dir"),
        (("--plan", "/no/such/plan.json"), "no such file"),
        (("--float8", "--dp", "2"), "--float8 with --dp or --tp is not supported"),
        (("--recompute", "full:4"), "names 4 layers of a stage that holds 3; K is from 1 to 3"),
        (("--recompute", "full,none,full"), "gives 3 modes for 2 stages"),
        (("--recompute", "half"), "unknown recompute mode 'half'; legal: 'none', 'selective'"),
    ],
)
def test_bad_arguments_are_refused_before_launching(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_arguments(_args(*argv))


def test_recompute_is_one_mode_for_every_stage_or_one_per_stage(tmp_path: Path) -> None:
    assert check_arguments(_args("--recompute", "selective")).recompute == ("selective",) * 2
    layout = check_arguments(
        _args("-s", "zbv", "--layers", "6", "--recompute", "full:1,none,none,full")
    )
    assert layout.stage_layers[0] > 1 and layout.recompute == ("full:1", "none", "none", "full")
    with pytest.raises(ValueError, match="drop --recompute"):
        check_arguments(_args("--plan", _plan_file(tmp_path), "--recompute", "full"))


def _plan_file(tmp_path: Path, **fields) -> str:
    plan = {"schedule": "zbv", "ranks": 2, "stages_per_rank": 2, "microbatches": 4}
    plan |= {"stage_layers": [1, 2, 2, 2], "predicted": {"step_ms": 1.0}} | fields
    plan = {k: v for k, v in plan.items() if v is not None}  # None: leave the field out
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))
    return str(path)


def test_a_plan_file_gives_the_layout_and_must_fit_the_model(tmp_path: Path) -> None:
    layout = check_arguments(_args("--plan", _plan_file(tmp_path)))  # llama, 4 blocks: 7 layers
    assert (layout.schedule, layout.ranks, layout.stages_per_rank) == ("zbv", 2, 2)
    assert (layout.microbatches, layout.stage_layers) == (4, (1, 2, 2, 2))
    with pytest.raises(ValueError, match="cuts 7 layers .* --model gpt --layers 4 has 6"):
        check_arguments(_args("--plan", _plan_file(tmp_path), "--model", "gpt"))
    with pytest.raises(ValueError, match="drop --ranks"):
        check_arguments(_args("--plan", _plan_file(tmp_path), "--ranks", "2"))
    with pytest.raises(ValueError, match="has no 'stage_layers'"):
        check_arguments(_args("--plan", _plan_file(tmp_path, stage_layers=None)))
    bad = _plan_file(tmp_path, stage_layers=[3, 4])
    with pytest.raises(ValueError, match="2 stages but ranks × stages_per_rank = 4"):
        check_arguments(_args("--plan", bad))
    (tmp_path / "plan.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        check_arguments(_args("--plan", str(tmp_path / "plan.json")))


def test_a_plan_file_carries_recompute_and_offload_refused_on_a_cpu_run(tmp_path: Path) -> None:
    from pipetrain.app.launch import _resolve_device

    modes = ["full", "selective", "none", "full"]
    layout = check_arguments(_args("--plan", _plan_file(tmp_path, recompute=modes)))
    assert layout.recompute == tuple(modes)
    assert check_arguments(_args("--plan", _plan_file(tmp_path))).recompute == ("none",) * 4
    config = _args("--plan", _plan_file(tmp_path, offload=[0, 0, 0, 0.5]), "--device", "cpu")
    layout = check_arguments(config)
    assert layout.offload == (0, 0, 0, 0.5)
    refused = r"offload \[0.0, 0.0, 0.0, 0.5\]\), which saves nothing on a CPU run"
    with pytest.raises(ValueError, match=refused):
        _resolve_device(config, layout)
    with pytest.raises(ValueError, match="offload"):
        check_arguments(_args("--plan", _plan_file(tmp_path, offload=[0, 0, 0, 1.5])))


def test_a_model_folders_pipeline_offloads_as_the_plan_says(monkeypatch) -> None:
    """``--model-dir`` builds its ``Pipeline`` itself (the folder's stages, not
    ``from_plan``): it passes the plan's offload and reload leads as ``from_plan`` does."""
    pytest.importorskip("transformers")
    import pipetrain.app.model_folder as model_folder
    import pipetrain.runtime.pipeline as pipeline
    from pipetrain.app.train import _pipeline
    from pipetrain.planner.layout import Layout

    given = {}

    def record(*args, **kwargs):
        given.update(kwargs)
        return "pipe"

    monkeypatch.setattr(model_folder, "folder_stages", lambda *args: (lambda s: None, False))
    monkeypatch.setattr(pipeline, "Pipeline", record)
    layout = Layout(schedule="1f1b", ranks=2, stages_per_rank=1, microbatches=4,
                    stage_layers=(3, 4), offload=(0.5, 0.0), reload_lead=(2, 1))  # fmt: skip
    assert _pipeline(_args(), layout, None, torch.device("cpu")) == ("pipe", 0)
    assert given["offload"] == layout.offload_spec and given["offload"].leads(2) == (2, 1)


def test_train_takes_the_shared_shape_flags_and_relaunches_with_them() -> None:
    args = _args("zb-h1", "-p", "2", "-m", "4", "--steps", "3")
    assert (args.schedule, args.ranks, args.microbatches) == ("zb-h1", 2, 4)
    flags = args.argv()
    assert flags[:6] == ["--schedule", "zb-h1", "--ranks", "2", "--microbatches", "4"]
    assert _args(*flags) == args  # a worker parses back the launcher's arguments
    with pytest.raises(SystemExit):  # argparse's exit 2: the same validator as every subcommand
        _args("-p", "0")


def test_every_subcommand_shares_one_definition_of_the_shape_flags() -> None:
    from pipetrain.cli import build_parser
    from pipetrain.cli.flags import positive_int

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    for name in ("show", "simulate", "compare", "train"):
        actions = {a.dest: a for a in commands[name]._actions}
        for dest in ("ranks", "microbatches", "stages_per_rank"):
            assert actions[dest].type is positive_int, (name, dest)


def test_defaults_train_a_tiny_llama_on_two_ranks() -> None:
    args = _args()
    layout = check_arguments(args)
    assert args.model == "llama" and (args.dp, args.tie_embeddings) == (1, False)
    assert (layout.schedule, layout.ranks, layout.microbatches) == ("1f1b", 2, 4)
    # 4 blocks spread evenly; the embedding joins the first stage, the norm and head the last
    assert layout.stage_layers == (3, 4)


@pytest.mark.parametrize(
    "name", ["1f1b", "zb-h1", "zbv", "dualpipev", "interleaved-1f1b", "interleaved-zb"]
)
def test_measured_costs_round_trip_through_the_simulator(name: str) -> None:
    program = build_schedule(name, 2, 4)
    n = program.num_stages
    costs = Costs(
        forward=[1.0 + s for s in range(n)],
        backward_input=[2.0 + s for s in range(n)],
        backward_weight=[0.5 + s for s in range(n)],
        backward=[3.0 + 2 * s for s in range(n)],
        forward_backward=[4.0 + 3 * s for s in range(n)] if name == "dualpipev" else None,
    )
    timeline = simulate(program, costs)
    recovered = measured_costs([timeline], n)
    again = simulate(program, recovered)
    assert again.makespan == pytest.approx(timeline.makespan)
    assert again.bubble_fraction == pytest.approx(timeline.bubble_fraction)


@pytest.mark.parametrize("weight_grads", ["auto", "replay"])
def test_train_smoke_two_processes(tmp_path: Path, weight_grads: str) -> None:
    pytest.importorskip("pipetrain.runtime.pipeline")
    svg = tmp_path / "step.svg"
    cmd = [sys.executable, "-m", "pipetrain", "train", "--ranks", "2", "--schedule", "zbv"]
    cmd += ["--model", "gpt", "--weight-grads", weight_grads]
    cmd += ["--steps", "5", "--layers", "4", "--hidden", "16", "--heads", "2", "--seq-len", "16"]
    cmd += ["--microbatches", "4", "--microbatch-size", "2", "--svg", str(svg), "--timeout", "60"]
    cmd += ["--trace", str(tmp_path / "step.json")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "loss" in done.stdout and "bubble" in done.stdout, done.stdout
    assert svg.exists() and svg.read_text().startswith("<svg")
    trace = json.loads((tmp_path / "step.json").read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    assert trace["otherData"]["source"] == "measured" and len(spans) == 2 * 4 * 3 * 2  # zbv


def test_a_worker_keeps_import_notices_that_say_nothing_of_the_run_out_of_its_output() -> None:
    """transformers imports torchao where it is installed; on a machine without the CUDA kernels
    torchao's extensions target, torchao and torch print warnings a worker keeps out."""
    pytest.importorskip("transformers")
    quiet = "from pipetrain.app.launch import quiet_import_notices; quiet_import_notices(); "
    code = quiet + "from transformers import LlamaForCausalLM"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr, done.stderr
    assert "register_constant" not in done.stderr, done.stderr


def test_train_refuses_bad_input_with_exit_2() -> None:
    """A real process: the exit status the shell sees (the flags below are refused in-process,
    by the same ``main``)."""
    cmd = [sys.executable, "-m", "pipetrain", "train", "--schedule", "nope"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "legal schedules" in done.stderr
    assert "Traceback" not in done.stderr


def _refused(capsys, *argv: str) -> str:
    """``pipetrain train ARGV`` in this process: it must exit with status 2 (argparse's error
    exit, no other exception); what it said on stderr."""
    from pipetrain.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", *argv])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_train_refuses_an_unknown_weight_gradient_split_with_exit_2(capsys) -> None:
    said = _refused(capsys, "--weight-grads", "later")
    assert "auto" in said and "deferred" in said and "replay" in said


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_train_refuses_a_bad_receive_lead_with_exit_2(capsys, value) -> None:
    said = _refused(capsys, "--receive-lead", value)
    assert f"expected none or an integer >= 0, got {value!r}" in said
