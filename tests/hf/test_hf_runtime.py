"""``pipetrain.hf``: tiny random ``transformers`` models cut into layers, float64 gradients equal
the unsplit model's on every runnable schedule at 2 and 4 ranks (gloo; one launch)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from hf_cases import ROWS, batch, build, run_schedules
from runtime_harness import launch

from pipetrain.schedule.registry import FAMILIES

# dualpipe holds two copies of the model; the runtime refuses it
NAMES = [str(n) for n in FAMILIES if n != "dualpipe"]


@pytest.mark.slow
def test_llama_and_gpt2_match_the_unsplit_model_on_every_schedule():
    """And Llama under FSDP2 / DDP on a 2 × 2 mesh against the unsplit model on the global
    batch."""
    plans = [
        (4, "llama", NAMES),
        (2, "llama", NAMES),
        (2, "gpt2", NAMES),
        (4, "gpt2", ["1f1b", "zbv"]),
        ("2x2", "fsdp", ["1f1b", "zbv"]),  # with data parallel on a (dp, pp) mesh
        ("2x2", "ddp", ["interleaved-1f1b"]),
    ]
    failures = launch(4, run_schedules, plans, timeout=300)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2-sliding", "mistral", "gpt2"])
def test_layers_chain_to_the_models_logits_and_keep_its_names(kind):
    """The layer list run in order is the model's forward (masks, rotary tables and sliding
    windows rebuilt per layer), and its parameter names are the model's state-dict keys."""
    import torch

    from pipetrain.hf import causal_lm_layers

    model = build(kind, layers=3)
    ids = batch()
    h = ids
    layers = causal_lm_layers(model)
    for layer in layers.values():
        h = layer(h)
    assert torch.equal(h, model(ids).logits)
    names = {f"{prefix}.{k}" for prefix, m in layers.items() for k in m.state_dict()}
    assert names == set(model.state_dict())
    assert h.shape == (ROWS, 8, 61)


def test_tied_weights_are_declared_by_global_name_only_where_tied():
    from pipetrain.hf import tied_weights

    assert tied_weights(build("gpt2-tied")) == [("transformer.wte.weight", "lm_head.weight")]
    assert tied_weights(build("gpt2")) == []
    assert tied_weights(build("llama")) == []


def test_unsupported_models_and_padded_labels_are_refused():
    import transformers as tf

    from pipetrain.hf import causal_lm_layers, causal_lm_loss

    gemma = tf.GemmaForCausalLM(
        tf.GemmaConfig(
            vocab_size=61,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
        )
    )
    with pytest.raises(ValueError, match=r"model types llama, qwen2, qwen3, mistral, gpt2; got"):
        causal_lm_layers(gemma)
    ids = batch()
    labels = ids.clone()
    labels[0, -1] = -100
    with pytest.raises(ValueError, match="ignore_index"):
        causal_lm_loss.check_targets(labels)
