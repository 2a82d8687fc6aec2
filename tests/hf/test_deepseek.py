"""DeepSeek-V3 as a layer list (``pipetrain.hf.deepseek``) and its auxiliary-loss-free balancing
(``pipetrain.hf.expert_bias``), in float64 on a tiny random model: dense first layer, MoE layers
with a shared expert, group-limited routing with a non-zero bias, multi-latent attention, YaRN.

Stages cut by hand give ``transformers``' logits and gradients, and count the same expert loads
as its router chose (padding excluded), once per micro-batch under recompute and never without
autograd; the bias update's rule; folders load exactly (bias and YaRN tables included) and a
folder holding multi-token-prediction weights is refused with its opt-out; on 2 gloo ranks, a
pipeline (1F1B recomputing whole stages, ZBV recomputing each layer) trained 3 steps with the bias update equals the unsplit
model under gradient accumulation (loss, every gradient, biases), exports and checkpoints keep
the trained bias, and data-parallel replicas sum their loads."""

from __future__ import annotations

import copy
import json
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
    causal_lm_layers,
    causal_lm_token_loss,
    family_of,
    from_pretrained,
    next_token_targets,
    packed_position_ids,
    tied_weights,
)
from pipetrain.hf.deepseek import DeepseekV3Layer
from pipetrain.hf.expert_bias import expert_loads, reset_expert_loads, update_expert_biases

VOCAB, SEQ, ROWS, EXPERTS, TOP_K = 53, 7, 4, 8, 2
RATE = 0.05  # large, so three updates change the routing
EAGER = {"experts_implementation": "eager"}  # grouped_mm takes no float64
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}


def config(tied: bool = False, **over):
    """3 layers (the first dense), 8 experts in 4 groups (top-2 groups, top-2 experts), one
    shared expert, low-rank queries and keys/values, YaRN."""
    import transformers as tf

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        moe_intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        kv_lora_rank=8,
        q_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=EXPERTS,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=TOP_K,
        first_k_dense_replace=1,
        n_shared_experts=1,
        max_position_embeddings=32,
        rope_parameters=YARN,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=1,
        **EAGER,
    )
    return tf.DeepseekV3Config(**(fields | over))


def build(tied: bool = False, **over):
    """The model in float64, its routers drawn wide (routing decided) and biases non-zero."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    model = AutoModelForCausalLM.from_config(config(tied, **over)).double()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                t.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                t.normal_(0.0, 0.05)
    return model.train()


def padded_batch(rows: int = ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids, and a mask with left padding (row 0) and right padding (row 2)."""
    ids = torch.randint(2, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[0, :3] = 0
    mask[2, -2:] = 0
    return ids, mask


def main_loss(logits, ids, mask):
    targets = next_token_targets(ids, attention_mask=mask)
    return causal_lm_token_loss(logits, targets) / (targets != -100).sum()


def reference_loads(model, ids, mask, **kwargs) -> dict[str, torch.Tensor]:
    """``transformers``' own forward, each router's chosen experts counted over the tokens the
    mask marks (every token without one), by the layer's name, and its logits under
    ``"logits"``."""
    chosen: dict[str, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if hasattr(gate, "e_score_correction_bias"):

            def keep(module, args, out, name=f"model.layers.{i}"):
                chosen[name] = out[2]

            hooks.append(gate.register_forward_hook(keep))
    try:
        logits = model(ids, attention_mask=mask, use_cache=False, **kwargs).logits
    finally:
        for hook in hooks:
            hook.remove()
    counted = (torch.ones_like(ids) if mask is None else mask).reshape(-1).bool()
    loads = {
        name: torch.bincount(picked[counted].reshape(-1), minlength=EXPERTS)
        for name, picked in chosen.items()
    }
    return {"logits": logits, **loads}


def counts(modules) -> dict[str, torch.Tensor]:
    return {n: load.counts for n, load in expert_loads(modules).items()}


def test_stages_give_transformers_logits_gradients_and_loads() -> None:
    """Three stages by hand: logits and gradients equal the model's; the loads counted equal
    the experts its routers chose for unpadded tokens; a forward without autograd counts
    nothing; the dense first layer has no counter; TP is refused like the other MoE families."""
    ids, mask = padded_batch()
    reference = build()
    ref = reference_loads(reference, ids, mask)
    main_loss(ref["logits"], ids, mask).backward()

    model = build()
    layers = causal_lm_layers(model)
    decoders = [layer for layer in layers.values() if isinstance(layer, DeepseekV3Layer)]
    assert [d.expert_load is not None for d in decoders] == [False, True, True]
    stages = pipetrain.split(layers, [2, 2, 2])
    with torch.no_grad():
        out = ids
        for stage in stages:
            out = stage(out, attention_mask=mask)
    assert all(c is None for c in counts(stages).values())
    logits = ids
    for stage in stages:
        logits = stage(logits, attention_mask=mask)
    assert _close(logits, ref["logits"], 1e-13)
    assert counts(stages).keys() == {"model.layers.1", "model.layers.2"}
    for name, load in counts(stages).items():
        assert torch.equal(load, ref[name]), name
        assert int(load.sum()) == TOP_K * int(mask.sum())  # padding not counted
    main_loss(logits, ids, mask).backward()
    theirs = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert _close(p.grad, theirs[name].grad), name
    # packed documents (position ids, no mask): transformers' logits, every token counted
    reset_expert_loads(stages)
    positions = packed_position_ids([[3, 4], [7], [2, 2, 3], [5]], SEQ)
    with torch.no_grad():
        packed = reference_loads(reference, ids, None, position_ids=positions)
        out = ids
        for stage in stages:
            out = stage(out, position_ids=positions)
    assert all(c is None for c in counts(stages).values())
    out = ids
    for stage in stages:
        out = stage(out, position_ids=positions)
    assert _close(out, packed["logits"], 1e-13)
    assert all(torch.equal(c, packed[n]) for n, c in counts(stages).items())
    family = family_of(model)
    assert family is FAMILIES["deepseek_v3"] and family.expert_bias and family.is_moe
    assert family.tensor_parallel is None and "expert tensor parallel" in (
        family.tensor_parallel_refusal
    )
    for tied in (False, True):
        assert family.tied_pairs(config(tied)) == tied_weights(build(tied, num_hidden_layers=1))


def test_the_bias_update_rule() -> None:
    """``rate · sign(mean − load)``, centred, compared in integers (a load at the mean moves
    nothing before centring); routing ignores the centring's common shift; the counts are
    cleared; rate 0 only clears; a bad rate is refused."""
    model = build(num_hidden_layers=2)
    layers = causal_lm_layers(model)
    load = layers["model.layers.1"].expert_load
    assert load is not None
    before = load.bias.clone()
    load.counts = torch.tensor([3, 1, 2, 2, 5, 0, 2, 1])  # mean 2: -, +, 0, 0, -, +, 0, +
    moved = update_expert_biases(layers.values(), 0.1)
    assert torch.equal(moved["model.layers.1"], torch.tensor([3, 1, 2, 2, 5, 0, 2, 1]))
    sign = torch.tensor([-1.0, 1, 0, 0, -1, 1, 0, 1], dtype=torch.float64)
    assert torch.allclose(load.bias - before, 0.1 * (sign - sign.mean()), rtol=0, atol=1e-15)
    assert load.counts is None
    gate = model.model.layers[1].mlp.gate
    hidden = torch.randn(20, 16, dtype=torch.float64)
    chosen = gate(hidden)[2].sort(dim=-1).values
    with torch.no_grad():
        gate.e_score_correction_bias += 0.3
    assert torch.equal(gate(hidden)[2].sort(dim=-1).values, chosen)
    load.counts = torch.tensor([9, 0, 0, 0, 0, 0, 0, 0])
    after = load.bias.clone()
    assert update_expert_biases(layers.values(), 0.0) == {} and load.counts is None
    assert torch.equal(load.bias, after)
    load.counts = torch.ones(EXPERTS, dtype=torch.int64)
    reset_expert_loads(layers.values())
    assert load.counts is None
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="expert bias rate must be a finite number >= 0"):
            update_expert_biases(layers.values(), bad)
    with pytest.raises(ValueError, match=r"\(rows, T\) attention_mask"):
        layers["model.layers.1"](
            torch.zeros(1, 4, 16, dtype=torch.float64),
            attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool),
        )


def write_folder(folder: Path, tied: bool = False) -> str:
    build(tied).save_pretrained(folder, **({"max_shard_size": "8KB"} if tied else {}))
    return str(folder)


def test_folders_load_exactly_and_recompute_counts_once(tmp_path) -> None:
    """The folder check passes; ``from_pretrained`` at a 3-3 cut reads every tensor (the bias
    included) and recomputes the YaRN tables as transformers does; logits equal the loaded
    model's; in bfloat16 the routers' weight and bias stay float32, as transformers keeps them. Full and selective recompute: same loads and gradients as without, the backward's
    recompute counting nothing."""
    from transformers import AutoModelForCausalLM

    from pipetrain.hf.pretrained import check_folder

    ids, mask = padded_batch()
    folder = write_folder(tmp_path / "tied", tied=True)
    check_folder(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **EAGER)
    built = list(from_pretrained(folder, [3, 3]))
    ours = {n: t for s in built for n, t in s.state_dict().items()}
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[n], t) for n, t in theirs.items())
    assert any(t.abs().sum() > 0 for n, t in ours.items() if n.endswith("correction_bias"))
    rotary = built[0].get_submodule("model.layers.0").rotary_emb
    assert torch.equal(rotary.inv_freq, model.model.rotary_emb.inv_freq)
    assert rotary.attention_scaling == model.model.rotary_emb.attention_scaling
    plain = 1.0 / (YARN["rope_theta"] ** (torch.arange(0, 4, 2, dtype=torch.float) / 4))
    assert not torch.allclose(rotary.inv_freq, plain)  # YaRN's table, not plain RoPE's
    logits = ids
    for stage in built:
        logits = stage(logits, attention_mask=mask)
    assert _close(logits, model(ids, attention_mask=mask).logits, 1e-13)
    (half,) = from_pretrained(folder, [6], dtype=torch.bfloat16)  # router kept in float32
    kept = {n: t.dtype for n, t in half.state_dict().items() if ".mlp.gate." in n}
    assert len(kept) == 4 and set(kept.values()) == {torch.float32}

    seen = {}
    for mode in ("none", "full", "selective"):
        (stage,) = from_pretrained(folder, [6], recompute=mode)
        main_loss(stage(ids, attention_mask=mask), ids, mask).backward()
        seen[mode] = (counts(stage), {n: p.grad for n, p in stage.named_parameters()})
    plain_loads, plain = seen.pop("none")
    for mode, (loads, grads) in seen.items():
        assert loads.keys() == plain_loads.keys()
        assert all(torch.equal(loads[n], c) for n, c in plain_loads.items()), mode
        assert all(torch.equal(grads[n], g) for n, g in plain.items()), mode


def test_a_folder_with_multi_token_prediction_weights_is_refused_with_its_opt_out(
    tmp_path,
) -> None:
    """A folder holding ``model.layers.{num_hidden_layers}.*`` (the MTP module, which
    transformers drops) is refused by the check and by ``from_pretrained``, naming the opt-out;
    with ``num_nextn_predict_layers: 0`` it loads (without them)."""
    from safetensors.torch import load_file, save_file

    from pipetrain.hf.pretrained import check_folder

    folder = tmp_path / "mtp"
    write_folder(folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(16, 32, dtype=torch.float64)
    tensors["model.layers.3.enorm.weight"] = torch.ones(16, dtype=torch.float64)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    refusal = (
        r"holds DeepSeek-V3 multi-token-prediction weights \(2 tensors under model\.layers\.3"
        r"\.\*.*set \"num_nextn_predict_layers\": 0 in its config\.json"
    )
    with pytest.raises(ValueError, match=refusal):
        check_folder(folder)
    with pytest.raises(ValueError, match=refusal):
        from_pretrained(folder, [6])
    settings = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(settings | {"num_nextn_predict_layers": 0}))
    check_folder(folder)
    assert len(from_pretrained(folder, [6])) == 1


def run_training(rank: int, world: int, folder: str, out: str) -> list[str]:
    """Data parallel first (each rank the whole model on half the rows: summed loads move the
    bias as the whole batch's), then 2 pipeline ranks: 1F1B with each stage recomputed as a
    whole, and ZBV with every decoder layer recomputed, each 3 SGD steps with the bias update against the unsplit model under gradient
    accumulation; then export and a DCP checkpoint of the ZBV run."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from pipetrain.hf import save_pretrained
    from pipetrain.runtime.backward.activation_checkpoint import recompute_stages

    ids, mask = padded_batch(8)
    targets = next_token_targets(ids, attention_mask=mask)
    failures: list[str] = []

    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, **EAGER)

    def whole_model():
        model = copy.deepcopy(loaded).train()
        (whole,) = pipetrain.split(causal_lm_layers(model), [6])
        return model, whole

    def reference(micro: int):
        """Losses per step, gradients of step 1, loads per step, biases after 3 steps."""
        model, whole = whole_model()
        losses, grads, loads = [], {}, []
        for step in range(3):
            model.zero_grad()
            total = torch.zeros((), dtype=torch.float64)
            for x, t, m in zip(*(v.chunk(micro) for v in (ids, targets, mask)), strict=True):
                loss = causal_lm_token_loss(whole(x, attention_mask=m), t)
                loss = loss / (targets != -100).sum()
                loss.backward()
                total += loss.detach()
            losses.append(total)
            if step == 0:
                grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.2 * p.grad
            loads.append(update_expert_biases(whole, RATE))
        biases = {n: t for n, t in model.state_dict().items() if "bias" in n}
        return losses, grads, loads, biases

    # data parallel: half the rows each, loads summed over the group
    model, whole = whole_model()
    with torch.no_grad():
        whole(ids.chunk(2)[rank], attention_mask=mask.chunk(2)[rank])
    assert all(c is None for c in counts(whole).values())  # no autograd: no count
    whole(ids.chunk(2)[rank], attention_mask=mask.chunk(2)[rank])
    summed = update_expert_biases(whole, RATE, dist.group.WORLD)
    alone, one = whole_model()
    one(ids, attention_mask=mask)
    expected = update_expert_biases(one, RATE)
    if not expected or any(not torch.equal(summed[n], c) for n, c in expected.items()):
        failures.append("dp: summed loads differ from the whole batch's")
    if any(not torch.equal(t, alone.state_dict()[n]) for n, t in model.state_dict().items()):
        failures.append("dp: biases differ from the whole batch's update")

    ref_losses, ref_grads, ref_loads, ref_biases = reference(4)
    for schedule, cut, recompute in (("1f1b", [3, 3], "whole"), ("zbv", [2, 1, 1, 2], "full")):
        if recompute == "whole":  # a gradient-free forward, then the recompute at the backward
            stages = recompute_stages(list(from_pretrained(folder, cut)), ["whole"] * len(cut))
        else:  # each decoder layer in a checkpoint, recomputed inside the backward
            stages = from_pretrained(folder, cut, recompute=recompute)
        pipe = pipetrain.Pipeline(stages, schedule, 4, causal_lm_token_loss)
        for step in range(3):
            for p in pipe.parameters():
                p.grad = None
            loss = pipe.step(ids, targets, side={"attention_mask": mask})
            if not _close(loss, ref_losses[step]):
                failures.append(f"{schedule} step {step}: loss {loss.item()} differs")
            if step == 0:
                for module in pipe.modules.values():
                    for n, p in module.named_parameters(remove_duplicate=False):
                        if not _close(p.grad, ref_grads[n]):
                            failures.append(f"{schedule}: {n} gradient differs")
            with torch.no_grad():
                for p in pipe.parameters():
                    p -= 0.2 * p.grad
            moved = update_expert_biases(pipe.modules.values(), RATE)
            held = {n for m in pipe.modules.values() for n in m.layer_names} & set(ref_loads[0])
            if set(moved) != held or any(
                not torch.equal(c, ref_loads[step][n]) for n, c in moved.items()
            ):
                failures.append(f"{schedule} step {step}: loads differ from the unsplit model's")
        trained = pipe.state_dict()
        for n, t in trained.items():
            if "bias" in n and not torch.equal(t, ref_biases[n]):
                failures.append(f"{schedule}: {n} differs after 3 steps")
        if schedule == "zbv":
            save_pretrained(pipe, f"{out}/export")
            loaded = AutoModelForCausalLM.from_pretrained(
                f"{out}/export", dtype=torch.float64, **EAGER
            ).state_dict()
            if any(not torch.equal(t, loaded[n]) for n, t in trained.items()):
                failures.append("transformers loads other values from the export")
            pipetrain.save_checkpoint(f"{out}/dcp", pipe)
            fresh = pipetrain.Pipeline(
                from_pretrained(folder, cut), schedule, 4, causal_lm_token_loss
            )
            pipetrain.load_checkpoint(f"{out}/dcp", fresh)
            if any(not torch.equal(t, trained[n]) for n, t in fresh.state_dict().items()):
                failures.append("the DCP checkpoint loads other values")
            fresh.close()
        pipe.close()
    return failures


@pytest.mark.slow
def test_pipeline_training_with_the_bias_update_equals_the_unsplit_model(tmp_path) -> None:
    folder = write_folder(tmp_path / "in")
    assert launch(2, run_training, folder, str(tmp_path / "out")) == [[], []]
    index = tmp_path / "out" / "export" / "model.safetensors.index.json"
    stored = set(json.loads(index.read_text())["weight_map"])
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in stored  # per expert, as released
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in stored
