"""``pipetrain.split``: a layer list cut by per-stage counts, global names, the lazy form."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from training_cases import SEQ, Block, build_layers, run_unsplit

import pipetrain
from pipetrain.runtime.named_layers import Stage


def test_stages_chain_the_layers_and_keep_global_names():
    layers = build_layers(6)
    stages = pipetrain.split(layers, [2, 3, 1])
    assert [s.layer_names for s in stages] == [
        ("embed", "blocks.0"),
        ("blocks.1", "blocks.2", "blocks.3"),
        ("head",),
    ]
    assert list(stages[1].state_dict()) == [
        f"blocks.{i}.lin.{w}" for i in (1, 2, 3) for w in ("weight", "bias")
    ]
    tokens = torch.randint(0, 11, (3, SEQ))
    h = tokens
    for s in stages:
        h = s(h)
    assert torch.equal(h, run_unsplit(layers, tokens))
    # the tied embedding/head (one Parameter in the first and the last stage) is found
    assert stages[0].tied_names == [("embed.weight", "head.weight")]


def test_counts_must_cover_every_layer_once():
    layers = [nn.Linear(2, 2) for _ in range(5)]
    with pytest.raises(ValueError, match="sums to 4 but the model has 5 layers"):
        pipetrain.split(layers, [2, 2])
    with pytest.raises(ValueError, match="sums to 6 but the model has 5 layers"):
        pipetrain.split(layers, [3, 3])
    with pytest.raises(ValueError, match=r"count below 1 \(0\).*of the 5 layers"):
        pipetrain.split(layers, [5, 0])
    with pytest.raises(TypeError, match="layer 1 is a str"):
        pipetrain.split([nn.Linear(2, 2), "x"], [1, 1])
    with pytest.raises(ValueError, match="pass num_layers="):
        pipetrain.split(lambda i: nn.Linear(2, 2), [1, 1])


def test_default_names_and_tuple_outputs_as_positional_arguments():
    class Pair(nn.Module):
        def forward(self, x):
            return x, x + 1

    class Add(nn.Module):
        def forward(self, a, b):
            return a * b

    (stage,) = pipetrain.split([Pair(), Add(), nn.Linear(2, 2)], [3])
    assert sorted(stage.state_dict()) == ["layers.2.bias", "layers.2.weight"]
    x = torch.ones(1, 2)
    assert torch.equal(stage(x), stage.get_submodule("layers.2")(x * (x + 1)))


def test_lazy_form_builds_only_the_stage_asked_for_and_materialises_meta_layers():
    built: list[int] = []

    def factory(i):
        built.append(i)
        return Block()

    def init(i, layer):
        assert layer.lin.weight.device.type == "cpu"  # materialised before init runs
        torch.manual_seed(i)
        layer.lin.weight.normal_()
        layer.lin.bias.zero_()

    stages = pipetrain.split(factory, [2, 2, 1], num_layers=5, init=init)
    assert len(stages) == 3 and built == []
    stage = stages[1]
    assert built == [2, 3] and isinstance(stage, Stage)
    assert next(iter(stage.state_dict())) == "layers.2.lin.weight"
    torch.manual_seed(3)
    assert torch.equal(
        stage.get_submodule("layers.3").lin.weight, torch.randn(6, 6, dtype=torch.float64)
    )
    # the cut does not change a layer's weights: layer 3 alone, built at another cut
    (other,) = pipetrain.split(factory, [3, 1, 1], num_layers=5, init=init)[1:2]
    assert torch.equal(
        other.get_submodule("layers.3").lin.weight, stage.get_submodule("layers.3").lin.weight
    )


def test_split_never_changes_the_layers_even_where_names_nest():
    """A layer named ``body`` and layers named ``body.blocks.i`` (GPT-2's embedding and blocks):
    the stage holds the embedding's children in a container of its own, so the given modules
    keep their children and the same layers can be cut again, at another cut."""

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(11, 4)

        def forward(self, tokens):
            return self.table(tokens)

    embed, blocks = Embed(), [nn.Linear(4, 4) for _ in range(3)]
    layers = {"body": embed, **{f"body.blocks.{i}": b for i, b in enumerate(blocks)}}
    first = pipetrain.split(layers, [2, 2])
    again = pipetrain.split(layers, [3, 1])
    assert [n for n, _ in embed.named_children()] == ["table"]
    assert all(not list(b.children()) for b in blocks)
    assert list(again[0].state_dict()) == [
        "body.table.weight",
        *(f"body.blocks.{i}.{w}" for i in (0, 1) for w in ("weight", "bias")),
    ]
    (whole,) = pipetrain.split(layers, [4])
    tokens = torch.randint(0, 11, (2, 3))
    assert torch.equal(whole(tokens), again[1](again[0](tokens)))
    assert torch.equal(whole(tokens), first[1](first[0](tokens)))
    whole.eval()
    assert not embed.training  # the layer held through the container follows the stage
    # the parameters are the layers' own (one object each)
    assert whole.get_submodule("body.table") is embed.table
    # a layer whose own tensors would sit on the path is refused, and a clash of names too
    own = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="holds parameters or buffers of its own"):
        pipetrain.split({"lin": own, "lin.sub": nn.Linear(4, 4)}, [2])
    with pytest.raises(ValueError, match="has a child 'table' and another layer is named"):
        pipetrain.split({"body.table": nn.Linear(4, 4), "body": Embed()}, [2])
