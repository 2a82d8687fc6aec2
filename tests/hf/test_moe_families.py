"""Mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral) as layer lists: logits equal to
``transformers``' model when cut into stages by hand, each MoE layer's router balancing loss
per micro-batch against the family's own ``load_balancing_loss_func`` applied layer by layer to
``transformers``' router logits (padding in the batch, gradients of the main loss plus the terms
to 1e-10 in float64), from_pretrained / save_pretrained / DCP round trips under a 2-rank
pipeline, the folder check, and the families refused with their reason."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch
from hf_cases import _close
from runtime_harness import launch

import pipetrain
from pipetrain.hf import (
    FAMILIES,
    ROUTER_AUX_LOSS,
    MoeDecoderLayer,
    causal_lm_layers,
    causal_lm_token_loss,
    family_of,
    from_pretrained,
    next_token_targets,
    tied_weights,
)
from pipetrain.runtime.extra_losses import take_extra_losses

VOCAB, SEQ, ROWS = 53, 7, 3
KINDS = ["qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss"]
COEF = 0.25  # large, so the router term weighs in the gradients
EAGER = {"experts_implementation": "eager"}  # grouped_mm takes no float64


def config(kind: str, *, layers: int = 3, router_loss: bool = True, tied: bool = False):
    """A tiny float64-sized config: 4 experts, top-2, hidden 16; Qwen-MoE with a dense middle
    layer (``mlp_only_layers``), Qwen2-MoE with its shared expert."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts_per_tok=2,
        output_router_logits=router_loss,
        router_aux_loss_coef=COEF,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=1,
        experts_implementation="eager",  # grouped_mm takes no float64
    )
    if kind == "mixtral":
        return tf.MixtralConfig(**common, num_local_experts=4)
    if kind == "gpt_oss":  # sliding and full layers alternate; attention sinks; eager attention
        return tf.GptOssConfig(**common, num_local_experts=4, head_dim=4, sliding_window=3)
    moe = dict(num_experts=4, moe_intermediate_size=8, mlp_only_layers=[1])
    if kind == "qwen2_moe":
        return tf.Qwen2MoeConfig(**common, **moe, shared_expert_intermediate_size=12)
    return tf.Qwen3MoeConfig(**common, **moe, head_dim=4, norm_topk_prob=True)


def build(kind: str, **kwargs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config(kind, **kwargs)).double()
    router = family_of(model).router
    with torch.no_grad():  # some routers start at zero: every expert tied, no top-k
        for name, p in model.named_parameters():
            if name.endswith(f"{router}.weight"):
                p.normal_(0.0, 0.5)
    return model.train()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a mask with left padding (row 0) and right padding (row 2)."""
    ids = torch.randint(2, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, -2:] = 0
    return ids, mask


def run_stages(stages, ids, mask):
    """The stages in sequence on one micro-batch, as a pipeline runs them."""
    out = ids
    for stage in stages:
        out = stage(out, attention_mask=mask)
    return out


def reference_router_loss(model, ids, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and Σ over MoE layers of coefficient × the family's balancing function on that
    layer's router logits (from ``transformers``' own forward), padding masked."""
    import importlib

    family = family_of(model)
    balance = importlib.import_module(family.balancing).load_balancing_loss_func
    out = model(ids, attention_mask=mask, output_router_logits=True)
    experts = getattr(model.config, family.num_experts)
    top_k = model.config.num_experts_per_tok
    terms = [balance((r,), experts, top_k, mask) for r in out.router_logits]
    return out.logits, COEF * torch.stack(terms).sum()


def main_loss(logits, ids, mask):
    targets = next_token_targets(ids, attention_mask=mask)
    return causal_lm_token_loss(logits, targets) / (targets != -100).sum()


@pytest.mark.parametrize("kind", KINDS)
def test_stages_give_transformers_logits_and_router_losses(kind) -> None:
    """Three stages by hand: logits equal the model's; Σ of the recorded router terms equals
    the layer-by-layer reference with padding excluded; gradients of main loss + terms equal
    the reference's to 1e-10."""
    ids, mask = padded_batch()
    reference = build(kind)
    ref_logits, ref_aux = reference_router_loss(reference, ids, mask)
    (main_loss(ref_logits, ids, mask) + ref_aux).backward()

    model = build(kind)
    layers = causal_lm_layers(model)
    moe = [n for n, layer in layers.items() if isinstance(layer, MoeDecoderLayer)]
    assert moe and all(isinstance(layers[n], MoeDecoderLayer) for n in moe)
    routed = [n for n in moe if layers[n].has_router]
    dense_middle = kind.startswith("qwen")  # Qwen-MoE's layer 1 is dense (mlp_only_layers)
    assert len(routed) == (2 if dense_middle else 3)
    stages = pipetrain.split(layers, [2, 1, 3])
    logits = run_stages(stages, ids, mask)
    assert _close(logits, ref_logits, 1e-13)
    terms = [take_extra_losses(stage) for stage in stages]
    assert [ROUTER_AUX_LOSS in t for t in terms] == [True, not dense_middle, True]
    aux = sum(t[ROUTER_AUX_LOSS] for t in terms if t)
    assert _close(aux, ref_aux, 1e-13), (aux.item(), ref_aux.item())
    # padding counted would change the term: the mask is what excludes it
    with torch.no_grad():
        unmasked = reference_router_loss(reference, ids, torch.ones_like(mask))[1]
    assert not _close(unmasked, ref_aux, 1e-6)
    (main_loss(logits, ids, mask) + aux).backward()
    theirs = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert _close(p.grad, theirs[name].grad), name
    assert all(not take_extra_losses(stage) for stage in stages)  # taken once


@pytest.mark.parametrize("kind", KINDS)
def test_no_router_term_unless_the_config_asks(kind) -> None:
    """``output_router_logits=False`` (released configs' default): transformers adds no router
    loss, and neither do the layers."""
    ids, mask = padded_batch()
    model = build(kind, router_loss=False)
    (stage,) = pipetrain.split(causal_lm_layers(model), [6])
    logits = run_stages([stage], ids, mask)
    assert _close(logits, model(ids, attention_mask=mask).logits, 1e-13)
    assert not take_extra_losses(stage)


def test_one_moe_layer_matches_transformers_own_aux_loss() -> None:
    """With one routed layer and one micro-batch the per-layer form is transformers' own:
    the CausalLM's ``aux_loss`` times the coefficient."""
    ids, mask = padded_batch()
    model = build("mixtral", layers=1)
    out = model(ids, attention_mask=mask, labels=ids)
    (stage,) = pipetrain.split(causal_lm_layers(model), [4])
    run_stages([stage], ids, mask)
    recorded = take_extra_losses(stage)[ROUTER_AUX_LOSS]
    assert _close(recorded, COEF * out.aux_loss, 1e-13)


def test_a_prepared_mask_is_refused_when_the_router_loss_counts_tokens() -> None:
    model = build("mixtral", layers=1)
    layer = causal_lm_layers(model)["model.layers.0"]
    hidden = torch.zeros(1, 4, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"\(rows, T\) attention_mask"):
        layer(hidden, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))


@pytest.mark.parametrize("tied", [False, True])
def test_the_table_ties_what_transformers_ties(tied) -> None:
    import transformers as tf

    for kind in KINDS:
        model = build(kind, layers=1, tied=tied)
        assert family_of(model).tied_pairs(model.config) == tied_weights(model), kind
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=8, n_layer=1, n_head=2, vocab_size=11))
    assert FAMILIES["gpt2"].tied_pairs(gpt2.config) == tied_weights(gpt2)


def test_tensor_parallel_is_refused_for_moe() -> None:
    from pipetrain.hf import parallelize_causal_lm

    layers = causal_lm_layers(build("qwen3_moe", layers=1))
    with pytest.raises(ValueError, match="--tp with MoE needs expert tensor parallel"):
        parallelize_causal_lm(layers, tp_mesh=_FakeMesh())


class _FakeMesh:
    def size(self) -> int:
        return 2


def write_folders(root: Path, kinds: list[str] = KINDS) -> dict[str, str]:
    """One folder per family: Mixtral tied in shards, the others untied in one file."""
    folders = {}
    for kind in kinds:
        folder = root / kind
        tied = kind == "mixtral"
        build(kind, router_loss=False, tied=tied).save_pretrained(
            folder, **({"max_shard_size": "8KB"} if tied else {})
        )
        folders[kind] = str(folder)
    return folders


def test_folders_pass_the_check_and_load_exactly(tmp_path) -> None:
    """The launcher's folder check accepts each family; ``from_pretrained`` at a 3-3 cut
    loads every tensor (buffers included) and chains to the loaded model's logits."""
    from transformers import AutoModelForCausalLM

    from pipetrain.hf.pretrained import check_folder

    ids, mask = padded_batch()
    for kind, folder in write_folders(tmp_path).items():
        check_folder(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **EAGER)
        stages = from_pretrained(folder, [3, 3])
        built = [stages[s] for s in range(2)]
        ours = {n: t for s in built for n, t in s.state_dict().items()}
        theirs = model.state_dict()
        assert set(ours) == set(theirs), kind
        assert all(torch.equal(ours[n], t) for n, t in theirs.items()), kind
        logits = run_stages(built, ids, mask)
        assert _close(logits, model(ids, attention_mask=mask).logits, 1e-13), kind


def test_recomputed_layers_record_the_same_terms_and_gradients(tmp_path) -> None:
    """Full and selective recompute of every decoder layer: the same recorded router term and
    the same gradients as without, and nothing recorded again by the backward's recompute."""
    ids, mask = padded_batch()
    build("mixtral", layers=2, router_loss=False).save_pretrained(tmp_path)  # on when loading
    seen = {}
    for mode in ("none", "full", "selective"):
        (stage,) = from_pretrained(tmp_path, [5], recompute=mode, output_router_logits=True)
        logits = stage(ids, attention_mask=mask)
        aux = take_extra_losses(stage)[ROUTER_AUX_LOSS]
        (main_loss(logits, ids, mask) + aux).backward()
        assert not take_extra_losses(stage), mode
        seen[mode] = (aux.detach(), {n: p.grad for n, p in stage.named_parameters()})
    plain_aux, plain = seen.pop("none")
    for mode, (aux, grads) in seen.items():
        assert torch.equal(aux, plain_aux), mode
        assert all(torch.equal(grads[n], g) for n, g in plain.items()), mode


def test_quantized_folders_and_packed_rows_where_transformers_ignores_them_are_refused(
    tmp_path,
) -> None:
    from pipetrain.hf.pretrained import check_folder

    model = build("gpt_oss", layers=1)
    model.config.quantization_config = {"quant_method": "mxfp4"}
    model.config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"quantized weights \(mxfp4\).*dequantize first"):
        check_folder(tmp_path)
    with pytest.raises(ValueError, match=r"quantized weights \(mxfp4\)"):
        from_pretrained(tmp_path, [4])
    (stage,) = pipetrain.split(causal_lm_layers(build("gpt_oss", layers=1)), [4])
    ids, _ = padded_batch()
    with pytest.raises(ValueError, match="^gpt_oss: .*packed documents would attend"):
        stage(ids, position_ids=torch.arange(SEQ).expand(ROWS, SEQ))


def test_refused_families_give_their_reason(tmp_path, monkeypatch) -> None:
    """A row of ``REFUSED`` (none today: every MoE family ``transformers`` has that pipetrain
    knows runs) is refused with its reason, by the folder check and by the table."""
    import transformers as tf

    from pipetrain.hf import families
    from pipetrain.hf.pretrained import check_folder

    model_type = "olmoe"
    monkeypatch.setitem(families.REFUSED, model_type, "its router is not known to pipetrain")
    config = tf.AutoConfig.for_model(model_type)
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"^{model_type}: not supported yet: .+"):
        check_folder(tmp_path)
    with pytest.raises(ValueError, match=f"^{model_type}: not supported yet"):
        family_of(config)


def run_pipeline_round_trip(rank: int, world: int, folders: dict[str, str], out: str) -> list:
    """Each family from its folder on 2 ranks under ZBV: loss and gradients against the loaded
    model (graph replay, then deferred weight gradients), then an SGD update,
    ``save_pretrained`` (transformers loads the trained values; ``from_pretrained`` reads the
    same layout above) and a DCP checkpoint into a fresh pipeline."""
    from transformers import AutoModelForCausalLM

    from pipetrain.hf import save_pretrained

    ids, mask = padded_batch()
    ids, mask = ids.repeat(2, 1), mask.repeat(2, 1)
    targets = next_token_targets(ids, attention_mask=mask)
    failures = []
    for kind, folder in folders.items():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **EAGER)
        ref = main_loss(model(ids, attention_mask=mask).logits, ids, mask)
        ref.backward()
        grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}

        def pipeline(defer: bool, case: str, folder=folder, ref=ref, grads=grads):
            stages = from_pretrained(folder, [2, 1, 1, 2])
            pipe = pipetrain.Pipeline(
                stages, "zbv", 2, causal_lm_token_loss, defer_weight_grads=defer
            )
            loss = pipe.step(ids, targets, side={"attention_mask": mask})
            if not _close(loss, ref):
                failures.append(f"{case}: loss {loss.item()} != {ref.item()}")
            for module in pipe.modules.values():
                for n, p in module.named_parameters(remove_duplicate=False):
                    if not _close(p.grad, grads[n]):
                        failures.append(f"{case}: {n} gradient differs")
            return pipe

        pipe = pipeline(False, f"{kind} graph replay")
        with torch.no_grad():
            for p in pipe.parameters():
                p -= 0.1 * p.grad
        trained = pipe.state_dict()
        save_pretrained(pipe, f"{out}/{kind}")
        loaded = AutoModelForCausalLM.from_pretrained(f"{out}/{kind}", dtype=torch.float64, **EAGER)
        theirs = loaded.state_dict()
        if any(not torch.equal(t, theirs[n]) for n, t in trained.items()):
            failures.append(f"{kind}: transformers loads other values")
        pipetrain.save_checkpoint(f"{out}/{kind}-dcp", pipe)
        fresh = pipeline(True, f"{kind} deferred weight gradients")
        pipetrain.load_checkpoint(f"{out}/{kind}-dcp", fresh)
        if any(not torch.equal(t, trained[n]) for n, t in fresh.state_dict().items()):
            failures.append(f"{kind}: the DCP checkpoint loads other values")
        pipe.close()
        fresh.close()
    return failures


@pytest.mark.slow
def test_pipeline_gradients_export_and_checkpoint(tmp_path) -> None:
    """Mixtral (tied, sharded, renamed experts) and Qwen2-MoE (a dense layer, a shared expert);
    the other families' folders are loaded exactly above and differ in no stored layout."""
    folders = write_folders(tmp_path / "in", ["mixtral", "qwen2_moe"])
    results = launch(2, run_pipeline_round_trip, folders, str(tmp_path / "out"))
    assert results == [[], []]
    import json

    for kind, expert_gate in (
        ("mixtral", "block_sparse_moe.experts.3.w1"),
        ("qwen2_moe", "mlp.experts.3.gate_proj"),
    ):
        index = json.loads((tmp_path / "out" / kind / "model.safetensors.index.json").read_text())
        stored = set(index["weight_map"])  # the original layout, as transformers writes it
        assert f"model.layers.0.{expert_gate}.weight" in stored, kind
        assert not any(n.endswith("gate_up_proj") for n in stored), kind
