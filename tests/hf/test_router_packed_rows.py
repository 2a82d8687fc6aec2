"""The router loss under packed rows excludes the padding at the end of each row exactly: the
rows' ``token_mask`` side input (1 for a document's token, 0 for the pad tail; packed rows have
no ``attention_mask``, their documents come from the position ids) weighs the family's balancing
function. Float64, per micro-batch and per layer, against the family's own
``load_balancing_loss_func`` applied to ``transformers``' router logits with the pad tail
masked; logits and every gradient of main loss + router terms to 1e-10."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("transformers")

import torch

import pipetrain
from pipetrain.hf import (
    ROUTER_AUX_LOSS,
    causal_lm_layers,
    causal_lm_token_loss,
    family_of,
    next_token_targets,
)
from pipetrain.hf.masks import packed_position_ids
from pipetrain.runtime.extra_losses import take_extra_losses

VOCAB, SEQ, COEF = 41, 10, 0.5
#: each row's document lengths; what is left of the row is its pad tail
DOCUMENTS = [[4, 3], [6], [10], [2, 2, 1]]
MICROBATCHES = 2


def build(kind: str):
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts_per_tok=2,
        output_router_logits=True,
        router_aux_loss_coef=COEF,
        experts_implementation="eager",
    )
    if kind == "mixtral":
        config = tf.MixtralConfig(**common, num_local_experts=4)
    elif kind == "qwen2_moe":
        config = tf.Qwen2MoeConfig(
            **common, num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=12
        )
    else:
        config = tf.Qwen3MoeConfig(
            **common, num_experts=4, moe_intermediate_size=8, head_dim=4, norm_topk_prob=True
        )
    torch.manual_seed(11)
    model = tf.AutoModelForCausalLM.from_config(config).double().train()
    with torch.no_grad():  # a zero router ties every expert: spread it
        for name, p in model.named_parameters():
            if name.endswith(f"{family_of(model).router}.weight"):
                p.normal_(0.0, 0.5)
    return model


def packed_batch():
    """Token ids (the pad tail filled with token 0), position ids as the packer makes them (the
    tail one more "document"), and the token mask (0 on the tail)."""
    ids = torch.randint(2, VOCAB, (len(DOCUMENTS), SEQ), generator=torch.Generator().manual_seed(3))
    positions = packed_position_ids(DOCUMENTS, SEQ)
    token_mask = torch.zeros(len(DOCUMENTS), SEQ, dtype=torch.long)
    for r, lengths in enumerate(DOCUMENTS):
        token_mask[r, : sum(lengths)] = 1
        ids[r, sum(lengths) :] = 0
    return ids, positions, token_mask


def targets_of(ids, positions, token_mask):
    targets = next_token_targets(ids, attention_mask=token_mask, position_ids=positions)
    return targets


def reference(model, ids, positions, counted) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per micro-batch: ``transformers``' logits, and Σ over layers of coefficient × the family's
    balancing function on that layer's router logits over ``counted``; the main loss and the
    router terms averaged over micro-batches, as the pipeline averages them."""
    family = family_of(model)
    balance = importlib.import_module(family.balancing).load_balancing_loss_func
    experts, top_k = getattr(model.config, family.num_experts), model.config.num_experts_per_tok
    targets = targets_of(ids, positions, counted)
    logits, main, aux = [], 0.0, 0.0
    for rows in torch.tensor_split(torch.arange(len(ids)), MICROBATCHES):
        out = model(
            ids[rows], position_ids=positions[rows], output_router_logits=True, use_cache=False
        )
        logits.append(out.logits)
        main = main + causal_lm_token_loss(out.logits, targets[rows])
        terms = [balance((r,), experts, top_k, counted[rows]) for r in out.router_logits]
        aux = aux + COEF * torch.stack(terms).sum() / MICROBATCHES
    return torch.cat(logits), main / (targets != -100).sum(), aux


def run_stages(model, ids, positions, token_mask):
    """Two stages by hand on each micro-batch, with the packed rows' side inputs."""
    stages = pipetrain.split(causal_lm_layers(model), [3, 2])
    targets = targets_of(ids, positions, token_mask)
    logits, main, aux = [], 0.0, 0.0
    for rows in torch.tensor_split(torch.arange(len(ids)), MICROBATCHES):
        side = {"position_ids": positions[rows]}
        if token_mask is not None:
            side["token_mask"] = token_mask[rows]
        out = ids[rows]
        for stage in stages:
            out = stage(out, **side)
        logits.append(out)
        main = main + causal_lm_token_loss(out, targets[rows])
        terms = [take_extra_losses(stage).get(ROUTER_AUX_LOSS, 0.0) for stage in stages]
        aux = aux + sum(terms) / MICROBATCHES
    return torch.cat(logits), main / (targets != -100).sum(), aux


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_the_pad_tail_of_packed_rows_is_not_counted(kind) -> None:
    ids, positions, token_mask = packed_batch()
    ref_model = build(kind)
    ref_logits, ref_main, ref_aux = reference(ref_model, ids, positions, token_mask)
    (ref_main + ref_aux).backward()

    model = build(kind)
    logits, main, aux = run_stages(model, ids, positions, token_mask)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-12)
    torch.testing.assert_close(aux, ref_aux, rtol=0, atol=1e-12)
    (main + aux).backward()
    theirs = dict(ref_model.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=0, atol=1e-10, msg=name)

    # the tail weighs in when counted: what the mask closes is a real difference
    with torch.no_grad():
        _, _, counted_all = reference(ref_model, ids, positions, torch.ones_like(token_mask))
        _, _, unmasked = run_stages(build(kind), ids, positions, None)
    torch.testing.assert_close(unmasked, counted_all, rtol=0, atol=1e-12)
    assert (unmasked - ref_aux).abs() > 1e-6


def test_a_token_mask_of_the_wrong_shape_is_refused_and_a_prepared_mask_needs_one() -> None:
    layer = causal_lm_layers(build("mixtral"))["model.layers.0"]
    hidden = torch.zeros(2, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"token_mask has shape \(2, 3\).*\(2, 4\)"):
        layer(hidden, token_mask=torch.ones(2, 3))
    prepared = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="does not say which tokens are padding"):
        layer(hidden, attention_mask=prepared)
    layer(hidden, attention_mask=prepared, token_mask=torch.ones(2, 4))  # the mask says it


def test_padding_in_both_masks_is_counted_once_and_dense_layers_take_the_mask() -> None:
    """Padded rows with a token mask too: a token counts where both say so."""
    from pipetrain.hf.router_losses import counted_tokens

    hidden = torch.zeros(2, 3, 4)
    attention = torch.tensor([[1, 1, 0], [0, 1, 1]])
    tokens = torch.tensor([[1, 0, 1], [1, 1, 1]])
    assert counted_tokens(hidden, attention, tokens).tolist() == [[1, 0, 0], [0, 1, 1]]
    assert counted_tokens(hidden, attention, None) is attention
    assert counted_tokens(hidden, None, tokens) is tokens
    assert counted_tokens(hidden, None, None) is None
    import transformers as tf

    dense = tf.Qwen3ForCausalLM(
        tf.Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=24,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=4,
        )
    )
    (stage,) = pipetrain.split(causal_lm_layers(dense), [4])
    ids, positions, token_mask = packed_batch()
    with torch.no_grad():
        got = stage(ids, position_ids=positions, token_mask=token_mask)
        torch.testing.assert_close(got, dense(ids, position_ids=positions, use_cache=False).logits)
