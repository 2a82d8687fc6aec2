"""``pipetrain profile --seq-lens`` (length costs fitted into the costs file), ``--model-dir`` (a
Hugging Face folder's own layers) and ``pipetrain.profile`` on a ``{name: layer}`` dict (CPU,
tiny shapes)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.cli import main
from pipetrain.planner.costs_file import LayerCost, ModelCosts, load_costs
from pipetrain.planner.varlen import model_length_cost

TINY_GPT = ["--model", "gpt", "--layers", "1", "--hidden", "8", "--heads", "2", "--vocab", "32"]
QUICK = ["--repeats", "1", "--context", "1", "--device", "cpu"]


def fake_profile(calls: list[dict]):
    """A stand-in for the profiler (measured for real in tests/runtime/test_profile.py): each
    layer's forward + backward per micro-batch is ``rows · (a·n + b·n²)`` for layer ``i``'s known
    ``a = 1e-3·(i+1)`` and ``b = 1e-5·i``, ``n`` the input's sequence length."""

    def profile(layers, sample_input, **kwargs):
        rows, n = sample_input.shape
        calls.append({"layers": list(layers), "input": sample_input, **kwargs})
        names = kwargs["names"] or [f"layer{i}" for i in range(len(layers))]
        per_row = [1e-3 * (i + 1) * n + 1e-5 * i * n * n for i in range(len(layers))]
        return ModelCosts(
            layers=tuple(
                LayerCost(
                    name=name,
                    forward=rows * t / 3,
                    backward_input=None,
                    backward_weight=None,
                    backward=2 * rows * t / 3,
                    activation=1.0,
                    params=1.0,
                )
                for name, t in zip(names, per_row, strict=True)
            ),
            meta={"device": "cpu", **kwargs["meta"]},
        )

    return profile


def test_seq_lens_fit_each_layers_length_cost_into_the_file(tmp_path, capsys, monkeypatch) -> None:
    import pipetrain.runtime.profile.profile_layers as profiler

    calls: list[dict] = []
    monkeypatch.setattr(profiler, "profile", fake_profile(calls))
    out = tmp_path / "costs.json"
    argv = ["profile", *TINY_GPT, "--seq-len", "16", "--seq-lens", "8,32", *QUICK]
    assert main([*argv, "--out", str(out), "--microbatch-size", "2"]) == 0
    assert [tuple(c["input"].shape) for c in calls] == [(2, 8), (2, 16), (2, 32)]
    costs = load_costs(out)
    assert [x.name for x in costs.layers] == ["embed", "block0", "head"]
    for i, layer in enumerate(costs.layers):
        assert layer.per_token == pytest.approx(1e-3 * (i + 1))
        assert layer.per_token_sq == pytest.approx(1e-5 * i, abs=1e-12)
    assert costs.meta["length_cost"] == {"seq_lens": [8, 16, 32], "rows": 2, "at": 16}
    assert costs.meta["seq_len"] == 16, "the file keeps --seq-len's times"
    assert costs.layers[2].forward == pytest.approx(2 * (3e-3 * 16 + 2e-5 * 256) / 3)
    assert model_length_cost(costs).per_token_sq == pytest.approx(3e-5)
    assert (
        "length cost per row: 0.006 ms per token + 3e-05 ms per token²" in capsys.readouterr().out
    )


def test_seq_lens_need_two_lengths(capsys) -> None:
    assert main(["profile", *TINY_GPT, "--seq-len", "16", "--seq-lens", "16", *QUICK]) == 2
    assert "fitting needs two or more distinct lengths" in capsys.readouterr().err


def write_llama(folder, blocks: int):  # type: ignore[no-untyped-def]
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=blocks,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model


def test_model_dir_hands_the_folders_own_layers_to_the_profiler(tmp_path, capsys, monkeypatch):
    import pipetrain.runtime.profile.profile_layers as profiler

    pytest.importorskip("transformers")
    model = write_llama(tmp_path / "llama", blocks=2).eval()
    calls: list[dict] = []
    monkeypatch.setattr(profiler, "profile", fake_profile(calls))
    out = tmp_path / "costs.json"
    folder = str(tmp_path / "llama")
    argv = ["profile", "--model-dir", folder, "--seq-len", "8", "--seq-lens", "4,16", *QUICK]
    assert main([*argv, "--out", str(out)]) == 0
    costs = load_costs(out)
    names = ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm", "lm_head"]
    assert [x.name for x in costs.layers] == names
    assert costs.meta["model_dir"] == folder and costs.meta["model"] == "llama"
    assert costs.layers[1].per_token_sq == pytest.approx(1e-5)
    # the layers handed over, chained, are the folder's model: its logits on the same tokens
    call = calls[0]
    tokens = call["input"]
    assert tokens.max() < 32 and call["target"] is tokens, "labels are the inputs (shifted by HF)"
    with torch.no_grad():
        x = tokens
        for layer in call["layers"]:
            x = layer.eval()(x)
        expected = model(tokens).logits
    torch.testing.assert_close(x, expected)
    assert main(["profile", "--model-dir", folder, "--layers", "3", *QUICK]) == 2
    assert "gives the model (its config.json): drop --layers" in capsys.readouterr().err
    too_long = ["profile", "--model-dir", folder, "--seq-len", "8", "--seq-lens", "64", *QUICK]
    assert main(too_long) == 2
    assert "--seq-lens reaches 64, longer than the model's max_position_embeddings 32" in (
        capsys.readouterr().err
    )


def test_a_folders_layers_are_profiled_for_real(tmp_path) -> None:
    pytest.importorskip("transformers")
    write_llama(tmp_path / "llama", blocks=1)
    out = tmp_path / "costs.json"
    argv = ["profile", "--model-dir", str(tmp_path / "llama"), "--seq-len", "4", *QUICK]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: threads only contend
    try:
        assert main([*argv, "--microbatch-size", "1", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    costs = load_costs(out)
    assert costs.num_layers == 4 and all(x.forward > 0 for x in costs.layers)
    embed_bytes = 32 * 16 * 4 * (1 + 1 + 2)  # weights, gradients, AdamW's two states: float32
    assert costs.layers[0].params * (1 << 30) == pytest.approx(embed_bytes)


def test_the_python_profile_takes_a_name_to_layer_dict() -> None:
    torch.manual_seed(0)
    layers = {"first": nn.Linear(4, 4), "second": nn.Linear(4, 4)}
    costs = pipetrain.profile(layers, torch.randn(2, 4), repeats=1, warmup=0, context=1)
    assert [x.name for x in costs.layers] == ["first", "second"]
    as_module_dict = pipetrain.profile(
        nn.ModuleDict(layers), torch.randn(2, 4), repeats=1, warmup=0, context=1
    )
    assert [x.name for x in as_module_dict.layers] == ["first", "second"]
    with pytest.raises(ValueError, match="do not pass names= as well"):
        pipetrain.profile(layers, torch.randn(2, 4), names=["a", "b"])
