"""``pipetrain profile --tp 1,2 --tp-measure processes``: degree 2 measured on two gloo processes
running the layers split by the plan ``train --tp`` uses (marked measured, the collectives
timed, each rank holding its share of the parameters), which ``plan --gpus`` reads; ``auto`` on
a CPU derives; what cannot be measured as asked is refused in one line; a failing worker is one
line too."""

from __future__ import annotations

import functools
import json
import operator
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.planner.costs_file import LayerCost, ModelCosts, load_costs

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY_LLAMA = ["--model", "llama", "--layers", "1", "--hidden", "8", "--heads", "2",
              "--kv-heads", "2", "--vocab", "32", "--seq-len", "4", "--microbatch-size", "2",
              "--repeats", "1", "--context", "1", "--device", "cpu"]  # fmt: skip
GIB = float(1 << 30)


@pytest.fixture
def degree_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """The degree-1 profile stands in (timing it is the profiler's own tests' business)."""
    from pipetrain.runtime.profile import profile_layers

    def fake(layers, *_, names=None, meta=None, **__) -> ModelCosts:
        one = dict(forward=1.0, backward_input=1.0, backward_weight=1.0, backward=2.0)
        return ModelCosts(
            layers=tuple(LayerCost(name=n, activation=1.0, params=1.0, **one) for n in names or ()),
            meta={**(meta or {}), "device": "cpu", "optimizer": "adamw"},
        )

    monkeypatch.setattr(profile_layers, "profile", fake)


def _local_bytes(split: dict[str, bool]) -> dict[str, int]:
    """Bytes of each layer's parameters one rank of two holds: the tiny Llama built as the
    profile builds it, a split matrix halved (Megatron-LM's split: every product, the
    embedding and the head by vocabulary), norms whole."""
    from pipetrain.app.catalog import build
    from pipetrain.cli.commands import build_parser
    from pipetrain.cli.flags import model_options, model_shape

    args = build_parser().parse_args(["profile", *TINY_LLAMA])
    assert {o.dest for o in model_options()} <= set(vars(args))
    layers = build(model_shape(args)).layers
    out = {}
    for name, layer in layers.items():
        total = 0
        for pname, p in layer.named_parameters():
            halved = split[name] and pname.endswith("weight") and p.dim() == 2
            total += p.numel() * p.element_size() // (2 if halved else 1)
        out[name] = total
    return out


def test_degree_two_is_measured_on_two_processes_of_the_split_layers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], degree_one: None
) -> None:
    out = tmp_path / "costs.json"
    argv = ["profile", *TINY_LLAMA, "--tp", "1,2", "--tp-measure", "processes", "--out", str(out)]
    assert main([*argv, "--context", "2"]) == 0
    assert "tensor parallel: degrees 1, 2 per layer; 2 measured (gloo" in capsys.readouterr().out
    raw = json.loads(out.read_text())
    assert raw["version"] == 3
    assert raw["meta"]["tp"]["measured"] == [2] and raw["meta"]["tp"]["derived"] == []
    # the times in windows of 2 layers, as the degree-1 profile's: embedding and block, norm and head
    windows = raw["meta"]["tp"]["windows"]["2"]
    assert [(w["first"], w["end"]) for w in windows] == [(0, 2), (2, 4)]
    costs = load_costs(out)
    assert costs.tp_degrees == (1, 2)
    by_name = {x.name: x.tp[0] for x in costs.layers}
    assert all(e.source == "measured" and e.degree == 2 for e in by_name.values())
    for e in by_name.values():
        assert min(e.forward, e.backward_input, e.backward_weight, e.activation) >= 0
        assert e.backward == pytest.approx(e.backward_input + e.backward_weight)
    assert sum(e.forward + e.backward for e in by_name.values()) > 0
    # the collectives the split layers really issue, timed on the group: the block reduces its
    # two regions' outputs and its column-split products' input gradients, the head gathers
    # its logits, the embedding reduces its vocabulary-split output; the norm is not split
    block, head, embed = (
        by_name["model.layers.0"],
        by_name["lm_head"],
        by_name["model.embed_tokens"],
    )
    assert block.forward_collective > 0 and block.backward_collective > 0
    assert head.forward_collective > 0 and embed.forward_collective > 0
    assert (
        by_name["model.norm"].forward_collective == 0 == by_name["model.norm"].backward_collective
    )
    # each rank holds half of every split matrix: parameters, gradients, AdamW's two states
    local = _local_bytes({name: name != "model.norm" for name in by_name})
    for name, e in by_name.items():
        assert e.params == pytest.approx(4 * local[name] / GIB), name
        assert e.gradients == pytest.approx(local[name] / GIB), name
    plan = ["plan", "--costs", str(out), "--gpus", "2", "--memory-gib", "100", "--json"]
    assert main(plan) == 0
    assert json.loads(capsys.readouterr().out)["stage_layers"]


def test_auto_on_a_cpu_derives_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], degree_one: None
) -> None:
    out = tmp_path / "costs.json"
    assert main(["profile", *TINY_LLAMA, "--tp", "1,2", "--out", str(out)]) == 0
    line = capsys.readouterr().out.splitlines()[-1]
    assert line.startswith("tensor parallel: degrees 1, 2 per layer; 2 derived (products split")
    assert "on a CPU" in line
    costs = load_costs(out)
    assert all(e.source == "derived" for x in costs.layers for e in x.tp)
    tp = costs.meta["tp"]
    assert tp["measured"] == [] and tp["derived"] == [2] and "on a CPU" in tp["why_derived"]["2"]
    # Llama's head is a layer of its own, named by the model: it gathers its logits
    head = costs.layers[-1]
    assert head.name == "lm_head" and head.tp[0].forward_collective > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model", "gpt", "--tp", "1,2", "--tp-measure", "processes"],
         "--tp-measure processes: degree 2: --model gpt has no tensor-parallel plan"),
        (["--tp", "1,4", "--tp-measure", "processes"],
         "--tp-measure processes: degree 4: tensor parallel of 4 does not divide --heads 2"),
        (["--tp-measure", "processes"], "--tp-measure processes applies to --tp degrees above 1"),
        (["--tp-measure", "derive"], "--tp-measure derive applies to --tp degrees above 1"),
    ],
)  # fmt: skip
def test_what_cannot_be_measured_as_asked_is_refused_in_one_line(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["profile", *TINY_LLAMA, *flags])  # a later --model wins
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and message in err, err


def test_a_failing_worker_is_one_line() -> None:
    from pipetrain.runtime.profile.profile_tp_measured import measure_degree

    broken = functools.partial(operator.truediv)  # (mesh, device): no such division
    with pytest.raises(ValueError, match=r"^measuring tensor-parallel degree 1: rank 0 failed: "
                       r"TypeError: unsupported operand") as e:  # fmt: skip
        measure_degree(broken, 1, "cpu", repeats=1)
    assert "\n" not in str(e.value)


def _write_folder(folder: Path, kind: str) -> Path:
    """A tiny Llama with a tied embedding and head, or a tiny Mixtral (no tensor-parallel
    plan), written as ``save_pretrained`` writes it."""
    import transformers as tf

    common = dict(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=8)  # fmt: skip
    torch.manual_seed(0)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=True))
    else:
        model = tf.MixtralForCausalLM(
            tf.MixtralConfig(**common, num_local_experts=2, num_experts_per_tok=1)
        )
    model.save_pretrained(folder)
    return folder


def test_a_folders_layers_are_measured_as_train_splits_them(tmp_path: Path) -> None:
    """The measuring path on a Llama folder, one rank in this process: its decoder layer split
    by the plan ``train --tp`` applies (DTensor weights), the tied embedding and head left
    whole as ``train --tp`` leaves them, and every layer measured, the tied weight counted once
    (as the degree-1 profile counts it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from pipetrain.cli.commands import build_parser
    from pipetrain.cli.profile_models import parallelized
    from pipetrain.runtime.profile.profile_tp_measured import measure_on_group

    folder = _write_folder(tmp_path / "llama", "llama")
    args = build_parser().parse_args(
        ["profile", "--model-dir", str(folder), "--seq-len", "4", "--microbatch-size", "2"]
    )
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        model = parallelized(args, 4, mesh["tp"], torch.device("cpu"))
        weights = {n: p for layer in model.layers for n, p in layer.named_parameters()}
        assert all(isinstance(p, DTensor) for n, p in weights.items() if "proj" in n), weights
        assert not any(isinstance(p, DTensor) for n, p in weights.items() if "embed" in n)
        entries, peaks, windows = measure_on_group(
            model,
            mesh["tp"].get_group(),
            torch.device("cpu"),
            repeats=1,
            optimizer="adamw",
            context=3,
        )
    finally:
        dist.destroy_process_group()
    assert len(entries) == len(model.layers) == 4 and peaks is None
    # windows of 3 layers: the first three chained; the head alone is no window
    assert [(w["first"], w["end"]) for w in windows] == [(0, 3)]
    assert windows[0]["forward"] > 0 and windows[0]["backward"] > 0
    unique = {id(p): p for layer in model.layers for p in layer.parameters()}
    total = sum(p.numel() * p.element_size() for p in unique.values())
    assert sum(e["params"] for e in entries) == pytest.approx(4 * total / GIB)
    assert all(e["forward"] >= 0 and e["activation"] > 0 for e in entries)


def test_a_folder_without_a_tensor_parallel_plan_is_refused_or_derived(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], degree_one: None
) -> None:
    folder = str(_write_folder(tmp_path / "mixtral", "mixtral"))
    capsys.readouterr()  # the writer's progress bars
    argv = ["profile", "--model-dir", folder, "--seq-len", "4", "--microbatch-size", "2",
            "--device", "cpu", "--tp", "1,2"]  # fmt: skip
    assert main([*argv, "--tp-measure", "processes"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--tp-measure processes: degree 2: mixtral has no tensor-parallel plan" in err
    out = tmp_path / "costs.json"
    assert main([*argv, "--out", str(out)]) == 0  # auto: derived, and the file says why
    why = load_costs(out).meta["tp"]["why_derived"]["2"]
    assert why.startswith("mixtral has no tensor-parallel plan")


def test_a_group_that_does_not_finish_is_stopped_with_one_line() -> None:
    """The parent's wait gives up at the timeout (its caller then kills the workers)."""
    import time

    from pipetrain.runtime.profile.profile_tp_measured import _wait

    class Stuck:  # a spawn context whose workers never end
        def join(self, timeout: float) -> bool:
            time.sleep(timeout)
            return False

    with pytest.raises(ValueError, match=r"^measuring tensor-parallel degree 2: the group did "
                       r"not finish within 0.3 s$"):  # fmt: skip
        _wait(Stuck(), 2, 0.3)


def test_windows_scale_each_layers_forward_and_backward_keeping_the_split() -> None:
    """Two layers timed alone and as one chain: each forward scaled by the chain's forward over
    their sum, each full backward and input part by the chain's backward over theirs; the
    collectives and the saved bytes untouched; a lone last layer unscaled."""
    from pipetrain.runtime.profile.profile_tp_measured import scale_by_windows

    # forward, backward, backward_input, forward collective, backward collective, activation
    rows = [[2.0, 4.0, 1.0, 0.5, 0.25, 7.0], [6.0, 8.0, 3.0, 0.5, 0.25, 9.0], [1, 1, 1, 0, 0, 1]]
    scaled, windows = scale_by_windows(rows, [(0, 2)], [[4.0, 6.0, 99.0]])
    assert windows == [{"first": 0, "end": 2, "forward": 0.5, "backward": 0.5}]
    assert scaled[0] == [1.0, 2.0, 0.5, 0.5, 0.25, 7.0]
    assert scaled[1] == [3.0, 4.0, 1.5, 0.5, 0.25, 9.0]
    assert scaled[2] == rows[2] and rows[0][0] == 2.0  # the input is not changed
