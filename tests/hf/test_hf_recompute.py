"""``from_pretrained(..., recompute=)``: chosen decoder layers run inside activation checkpoints
(full or selective), the loss and every gradient equal to ``transformers``' unsplit float64 model
on zero-bubble schedules with deferred weight gradients and with graph replay, and on 1F1B
(2 gloo ranks, one launch); parameter names untouched; bad values refused at construction."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch
from hf_cases import build
from hf_recompute_cases import CASES, DECODERS, expected_modes, run_recompute, write_folder
from runtime_harness import launch

from pipetrain.hf import from_pretrained
from pipetrain.runtime.backward.activation_checkpoint import Recomputed


@pytest.mark.slow
def test_recomputed_layers_train_exactly_as_the_unsplit_model(tmp_path):
    results = launch(2, run_recompute, write_folder(tmp_path), timeout=300)
    problems = [f for r in results for f in r["failures"]]
    assert not problems, "\n".join(problems)
    for label, _, _, m, _, recompute in CASES:
        modes = {n: mode for r in results for n, mode in r["modes"][label].items()}
        calls = {n: c for r in results for n, c in r["calls"][label].items()}
        assert modes == expected_modes(recompute), label
        for name, mode in modes.items():  # a recomputed layer's forward runs again in backward
            assert calls[name] == m if mode == "none" else calls[name] >= 2 * m, (label, name)


def test_only_the_chosen_decoder_layers_are_wrapped_and_names_stay(tmp_path):
    build("gpt2-tied", 3).save_pretrained(tmp_path)
    (plain,) = from_pretrained(tmp_path, [6])
    (stage,) = from_pretrained(tmp_path, [6], recompute={0: "full", 2: "selective", 1: "none"})
    wrapped = {
        name: layer.mode
        for name, (layer, _) in zip(stage.layer_names, stage.chain, strict=True)
        if isinstance(layer, Recomputed)
    }
    assert wrapped == {"transformer.h.0": "full", "transformer.h.2": "selective"}
    assert list(stage.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in stage.named_parameters()] == [n for n, _ in plain.named_parameters()]
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.equal(stage(ids), plain(ids))
    (every,) = from_pretrained(tmp_path, [6], recompute="full")
    assert [type(layer).__name__ for layer, _ in every.chain] == [
        "GPT2Embedding", "Recomputed", "Recomputed", "Recomputed", "LayerNorm", "Linear",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("recompute", "message"),
    [
        ("everything", r"recompute='everything'; legal modes: 'none', 'selective', 'full'"),
        ({0: "half"}, r"mode 'half' for decoder layer 0; legal: 'none', 'selective', 'full'"),
        ({DECODERS: "full"}, rf"decoder layer {DECODERS}, but the model has {DECODERS} \(indices"),
        ({-1: "full"}, r"decoder layer -1, but the model has"),
        ({"0": "full"}, r"key '0'; its keys are decoder layer indices, integers 0 to 3"),
        ({1.0: "full"}, r"key 1.0; its keys are decoder layer indices"),
        ({True: "full"}, r"key True; its keys are decoder layer indices"),
        (["full"], r"give a mode \('none', 'selective', 'full'\) or a mapping"),
    ],
)
def test_bad_recompute_values_are_refused_at_construction(tmp_path, recompute, message):
    build("llama", DECODERS).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        from_pretrained(tmp_path, [DECODERS + 3], recompute=recompute)
