"""Attention masks and packed documents through ``pipetrain.hf``: left and right padding and
packed rows give the ``transformers`` model's logits exactly (SDPA, every model kind; FlexAttention
in float32), the targets count the tokens ``transformers``' loss counts, and on 2 ranks float64
loss and gradients equal the unsplit model's with ``token_mean`` over the whole batch."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("transformers")

import torch
import torch.nn.functional as F
from hf_cases import SEQ, batch, build
from hf_mask_cases import ROWS, run_masked, side_inputs
from runtime_harness import launch

import pipetrain
from pipetrain.hf import (
    causal_lm_layers,
    causal_lm_loss,
    causal_lm_token_loss,
    next_token_targets,
    packed_position_ids,
)

VARIANTS = ["left", "right", "packed", "left+positions"]


def _side(variant: str) -> dict[str, torch.Tensor]:
    if variant == "left+positions":  # generation-style positions: they restart after the pads
        mask = side_inputs("left")["attention_mask"]
        return {"attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    return side_inputs(variant)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen2-sliding", "mistral", "gpt2"])
def test_layers_match_the_model_given_the_same_masks_and_positions(kind):
    model = build(kind, layers=3)
    (stage,) = pipetrain.split(causal_lm_layers(model), [6])
    ids = batch(ROWS)
    for variant in VARIANTS:
        side = _side(variant)
        assert torch.equal(stage(ids, **side), model(ids, **side, use_cache=False).logits), variant


def test_packed_rows_attend_within_their_document_only():
    """A token's logits do not depend on the documents before it in its row."""
    model = build("llama", layers=2)
    (stage,) = pipetrain.split(causal_lm_layers(model), [5])
    ids = batch(2)
    positions = packed_position_ids([[3, 5], [3, 5]], SEQ)
    other = ids.clone()
    other[1, :3] = (ids[1, :3] + 1) % 61  # another first document in row 1
    a = stage(ids, position_ids=positions)
    b = stage(other, position_ids=positions)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1, 3:], b[1, 3:])
    assert not torch.equal(a[1, :3], b[1, :3])


def test_targets_are_transformers_shifted_labels_and_count_the_predicted_tokens():
    ids = batch(ROWS)
    mask = side_inputs("right")["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)  # how a collator pads labels
    hf_shift = F.pad(labels, (0, 1), value=-100)[:, 1:]  # transformers' ForCausalLMLoss
    assert torch.equal(next_token_targets(ids, attention_mask=mask), hf_shift)
    assert torch.equal(next_token_targets(labels), hf_shift)
    # packed: the first token of each document is not a target (a collator's -100 there)
    positions = packed_position_ids([[3, 5]], SEQ)
    targets = next_token_targets(ids[:1], position_ids=positions)
    expected = ids[:1, 1:].tolist()[0] + [-100]
    expected[2] = -100  # token 2 ends document 0; token 3 starts document 1
    assert targets.tolist() == [expected]
    # the loss: transformers' with those labels (it upcasts logits to float32)
    model = build("llama", layers=2)
    out = model(ids, attention_mask=mask, labels=labels, use_cache=False)
    ours = causal_lm_token_loss(out.logits, hf_shift) / (hf_shift != -100).sum()
    assert torch.allclose(ours, out.loss.double(), rtol=1e-6)
    with pytest.raises(ValueError, match="do not align"):
        causal_lm_token_loss(out.logits, ids[:, 1:])
    with pytest.raises(ValueError, match="next_token_targets"):
        causal_lm_loss.check_targets(labels)
    with pytest.raises(ValueError, match="do not fit a row of 8"):
        packed_position_ids([[5, 4]], SEQ)


def _flex_case(device: str):
    """Llama with FlexAttention in float32 on ``device``: (stage, model) sharing weights."""
    model = build("llama", layers=2).float()
    model.config._attn_implementation = "flex_attention"
    model.to(device)
    (stage,) = pipetrain.split(causal_lm_layers(model), [5])
    return stage, model


@pytest.mark.slow
def test_flex_attention_forward_on_the_cpu():
    """FlexAttention builds a BlockMask per layer; on the CPU it runs forward only, in float32
    (torch compiles it for each shape)."""
    stage, model = _flex_case("cpu")
    ids = batch(ROWS)
    with torch.no_grad():
        for variant in ("packed", "left"):
            side = side_inputs(variant)
            ours = stage(ids, **side)
            assert torch.equal(ours, model(ids, **side, use_cache=False).logits), variant


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs a GPU")
def test_flex_attention_forward_and_backward_on_cuda():
    stage, model = _flex_case("cuda")
    ids = batch(ROWS).cuda()
    for variant in ("packed", "left"):
        side = {k: v.cuda() for k, v in side_inputs(variant).items()}
        targets = next_token_targets(ids, **side)
        model.zero_grad()
        ours = causal_lm_token_loss(stage(ids, **side), targets)
        ours.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        logits = model(ids, **side, use_cache=False).logits
        theirs = causal_lm_token_loss(logits, targets)
        theirs.backward()
        assert torch.equal(ours, theirs), variant
        for n, p in model.named_parameters():
            assert torch.equal(grads[n], p.grad), (variant, n)


@pytest.mark.slow
def test_padded_and_packed_batches_match_the_unsplit_model_on_2_ranks():
    plans = [
        ("llama", "left", ["1f1b", "zbv"]),
        ("llama", "right", ["interleaved-1f1b", "zb-h1"]),
        ("llama", "packed", ["1f1b", "dualpipev"]),
        ("gpt2", "left", ["1f1b", "zbv"]),
        ("gpt2", "packed", ["zbv"]),
        ("qwen2-sliding", "packed", ["1f1b"]),
        ("mistral", "right", ["zbv"]),
    ]
    failures = launch(2, run_masked, plans, timeout=300)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)


def test_a_stage_builds_its_mask_and_rotary_table_once_a_call_and_again_when_they_change(
    monkeypatch,
):
    """Three decoder layers share what they build from the side inputs (``BuiltOnce``): one mask
    per call, one rotary table per positions; a mask changed in place, new side inputs and
    checkpointed layers (whose recompute must repeat their forward) build afresh, and the
    logits stay the model's."""
    import transformers.masking_utils as masking
    from torch.utils.checkpoint import checkpoint

    model = build("llama", layers=3)
    layers = causal_lm_layers(model)
    (stage,) = pipetrain.split(layers, [len(layers)])
    masks_built, tables_built = [], []
    make_mask = masking.create_causal_mask
    monkeypatch.setattr(
        masking, "create_causal_mask", lambda **kw: masks_built.append(1) or make_mask(**kw)
    )
    rotary = type(model.model.rotary_emb)  # the stage holds copies: count on the class
    make_table = rotary.forward
    monkeypatch.setattr(
        rotary, "forward", lambda *a, **k: tables_built.append(1) or make_table(*a, **k)
    )
    ids, side = batch(ROWS), side_inputs("left")

    def check(masks: int, tables: int) -> None:
        masks_built.clear(), tables_built.clear()
        got = stage(ids, **side)
        assert (len(masks_built), len(tables_built)) == (masks, tables)
        assert torch.equal(got, model(ids, **side, use_cache=False).logits)

    check(1, 1)
    side["attention_mask"][0, :5] = 0  # in place: the same tensor, other values
    check(1, 0)  # the rotary table depends on the positions alone (here 0..T-1)
    check(0, 0)  # the same inputs again (another step of the same batch)
    side = side_inputs("right")  # new tensors
    check(1, 0)
    with torch.no_grad():
        check(0, 0)
    side["position_ids"] = torch.arange(SEQ).expand(ROWS, SEQ)
    check(1, 1)
    blocks = [layers[f"model.layers.{i}"] for i in range(3)]
    for block in blocks:  # each layer checkpointed on its own, as recompute wraps them
        monkeypatch.setattr(
            block, "forward", functools.partial(checkpoint, block.forward, use_reentrant=False)
        )
    masks_built.clear()
    got = stage(ids, **side)
    assert len(masks_built) == 3 and torch.equal(got, model(ids, **side, use_cache=False).logits)
    got.sum().backward()  # the recompute builds again, the same operations as the forward
    assert len(masks_built) == 6
