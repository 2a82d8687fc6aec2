"""The experts' kernel: ``transformers``' grouped path equals its loop over experts (float64,
its fallback GEMM where torch has no kernel for the dtype: forward and every gradient to 1e-12,
Qwen3-MoE and Mixtral); the fixed rule (device, dtype → grouped or loop) and its overrides; each
MoE layer runs the kernel the rule picks for the tensors it is given, without touching the
model's config; and the CPU grouped kernel through the layers agrees with the loop in float32."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import torch

from pipetrain.hf import causal_lm_layers
from pipetrain.hf.experts_kernel import (
    EXPERTS_CHOICES,
    GROUPED_MM,
    LOOP,
    ExpertsSetting,
    describe,
    experts_implementation,
    experts_modules,
    grouped_kernel_available,
    use_experts,
)

KINDS = ["qwen3_moe", "mixtral"]


def tiny_model(kind: str, dtype: torch.dtype, implementation: str = LOOP):
    """A two-layer model of 4 experts, top-2, hidden 16, router weights spread so top-2 is
    decided (a zero router ties every expert)."""
    import transformers as tf

    common = dict(
        vocab_size=37,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_experts_per_tok=2,
        experts_implementation=implementation,
    )
    if kind == "mixtral":
        config = tf.MixtralConfig(**common, num_local_experts=4)
    else:
        config = tf.Qwen3MoeConfig(
            **common, num_experts=4, moe_intermediate_size=8, head_dim=4, norm_topk_prob=True
        )
    torch.manual_seed(3)
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0.0, 0.5)
    return model


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_path_equals_the_loop_in_float64(kind, monkeypatch) -> None:
    """transformers' grouped path (sort by expert, offsets, one GEMM per projection through its
    fallback, weights, un-permute) against its per-expert loop, same weights, float64."""
    from transformers.integrations import moe

    calls = []
    fallback = moe._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return fallback(*args, **kwargs)

    # the CPU kernel takes no float64: transformers' own fallback GEMM, as where no kernel is
    monkeypatch.setattr(moe, "_can_use_grouped_mm", lambda *a: False)
    monkeypatch.setattr(moe, "_grouped_mm", counted)
    model = tiny_model(kind, torch.float64)
    ids = torch.randint(0, 37, (3, 9), generator=torch.Generator().manual_seed(1))
    model.config._experts_implementation = LOOP
    loop_logits, loop_grads = loss_and_grads(model, ids)
    assert not calls
    model.config._experts_implementation = GROUPED_MM
    grouped_logits, grouped_grads = loss_and_grads(model, ids)
    assert len(calls) == 2 * 2  # 2 layers × 2 projections (its backward: the op's own)
    torch.testing.assert_close(grouped_logits, loop_logits, rtol=0, atol=1e-12)
    experts = [n for n in loop_grads if "experts" in n]
    assert len(experts) == 4 and all(loop_grads[n].abs().sum() > 0 for n in experts)
    for name, grad in loop_grads.items():
        torch.testing.assert_close(grouped_grads[name], grad, rtol=0, atol=1e-12, msg=name)


def test_the_rule_picks_the_grouped_kernel_only_on_cuda_bf16_hopper_or_later(monkeypatch) -> None:
    cuda = torch.device("cuda")
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability["value"])
    assert grouped_kernel_available(cuda, torch.bfloat16)
    assert experts_implementation("auto", cuda, torch.bfloat16) == GROUPED_MM
    for dtype in (torch.float16, torch.float32, torch.float64):  # no CUTLASS path for these
        assert experts_implementation("auto", cuda, dtype) == LOOP
    capability["value"] = (10, 0)
    assert experts_implementation("auto", "cuda:0", torch.bfloat16) == GROUPED_MM
    capability["value"] = (8, 0)  # Ampere: ATen's fallback loop, not a grouped kernel
    assert experts_implementation("auto", cuda, torch.bfloat16) == LOOP
    assert "loop over experts" in describe("auto", cuda, torch.bfloat16)
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        assert experts_implementation("auto", "cpu", dtype) == LOOP
    assert experts_implementation("grouped", "cpu", torch.float32) == GROUPED_MM
    assert experts_implementation("loop", cuda, torch.bfloat16) == LOOP
    assert describe("grouped", "cpu", torch.float32).endswith("(--experts grouped)")
    with pytest.raises(ValueError, match="float64"):
        experts_implementation("grouped", "cpu", torch.float64)
    with pytest.raises(ValueError, match="legal: auto, grouped, loop"):
        experts_implementation("batched_mm", "cpu", torch.float32)
    assert EXPERTS_CHOICES == ("auto", "grouped", "loop")


def spy_implementations(layers) -> list[str]:
    """What each experts module reads as its implementation when it runs."""
    seen: list[str] = []
    for layer in layers:
        for module in experts_modules(layer):
            module.register_forward_pre_hook(
                lambda m, args: seen.append(m.config._experts_implementation)
            )
    return seen


def run_layers(layers, ids):
    out = ids
    for layer in layers:
        out = layer(out)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_each_layer_runs_what_the_rule_picks_for_its_tensors(kind) -> None:
    model = tiny_model(kind, torch.float64, implementation=GROUPED_MM)
    layers = torch.nn.ModuleList(causal_lm_layers(model).values())
    seen = spy_implementations(layers)
    ids = torch.randint(0, 37, (2, 5))
    run_layers(layers, ids)
    assert seen == [LOOP, LOOP]  # auto, CPU float64: the loop, whatever the config said
    assert model.config._experts_implementation == GROUPED_MM  # the config is left alone
    assert use_experts(layers, "grouped") == 2
    with pytest.raises(ValueError, match="float64"):
        run_layers(layers, ids)
    with pytest.raises(ValueError, match="legal"):
        use_experts(layers, "fast")
    assert all(isinstance(m.config, ExpertsSetting) for m in experts_modules(model))
    assert experts_modules(model)[0].config.num_experts_per_tok == 2  # the rest: the config's


@pytest.mark.parametrize("kind", KINDS)
def test_the_cpu_grouped_kernel_through_the_layers_agrees_with_the_loop(kind, monkeypatch) -> None:
    """float32, torch's own CPU grouped_mm (not transformers' fallback): same logits and
    gradients as the loop to float32 rounding."""
    from transformers.integrations import moe

    if not moe._can_use_grouped_mm(torch.zeros(1, 16), torch.zeros(1, 16, 8), torch.ones(1)):
        pytest.skip("this torch has no CPU grouped_mm kernel")
    kernel_calls = []
    original = torch.nn.functional.grouped_mm

    def counted(*args, **kwargs):
        kernel_calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "grouped_mm", counted)
    model = tiny_model(kind, torch.float32)
    layers = torch.nn.ModuleList(causal_lm_layers(model).values())
    ids = torch.randint(0, 37, (3, 8), generator=torch.Generator().manual_seed(2))
    results = {}
    for choice in ("loop", "grouped"):
        use_experts(layers, choice)
        model.zero_grad(set_to_none=True)
        logits = run_layers(layers, ids)
        logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[choice] = (logits.detach(), grads, len(kernel_calls))
    assert results["loop"][2] == 0 and results["grouped"][2] == 4  # 2 layers × 2 projections
    torch.testing.assert_close(results["grouped"][0], results["loop"][0], rtol=1e-5, atol=1e-6)
    for name, grad in results["loop"][1].items():
        torch.testing.assert_close(results["grouped"][1][name], grad, rtol=1e-4, atol=1e-6)


def test_train_takes_experts_for_moe_folders_only(tmp_path, capsys) -> None:
    """``--experts`` is refused (one line, exit 2) on the built-in model, a dense folder, and as
    ``grouped`` in float64; a Mixtral folder's stages run the kernel it names, and rank 0 says
    which once."""
    from pipetrain.app.config import TrainConfig
    from pipetrain.app.model_folder import folder_stages
    from pipetrain.app.train_checks import _check_experts
    from pipetrain.cli import main
    from pipetrain.planner.layout import Layout

    assert main(["train", "--experts", "loop"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(
        "--experts loop: the built-in --model llama has no experts; it is for "
        "a mixture-of-experts --model-dir folder: drop it"
    )
    with pytest.raises(ValueError, match="dense 'qwen3' model, which has no experts"):
        _check_experts(TrainConfig(model_dir="x", experts="grouped"), "qwen3")
    with pytest.raises(ValueError, match="no grouped GEMM takes float64; use --experts loop"):
        _check_experts(TrainConfig(model_dir="x", experts="grouped", dtype="float64"), "mixtral")
    _check_experts(TrainConfig(model_dir="x", experts="grouped", dtype="float32"), "mixtral")

    tiny_model("mixtral", torch.float32).save_pretrained(tmp_path)
    layout = Layout(schedule="1f1b", ranks=1, stages_per_rank=1, microbatches=1, stage_layers=(5,))
    for choice in EXPERTS_CHOICES:
        config = TrainConfig(model_dir=str(tmp_path), experts=choice, dtype="float32")
        stage, _ = folder_stages(config, layout, None, torch.device("cpu"))
        assert f"(--experts {choice}" in capsys.readouterr().out
        module = stage(0)
        chosen = [m.experts_choice for m in module.modules() if hasattr(m, "experts_choice")]
        assert chosen == [choice, choice]


def test_from_pretrained_takes_the_choice_or_transformers_name_for_it(tmp_path) -> None:
    from pipetrain.hf import from_pretrained

    tiny_model("qwen3_moe", torch.float32).save_pretrained(tmp_path)

    def chosen(**kwargs) -> list[str]:
        stage = from_pretrained(tmp_path, [5], **kwargs)[0]
        return [m.experts_choice for m in stage.modules() if hasattr(m, "experts_choice")]

    assert chosen() == ["auto", "auto"]
    assert chosen(experts="grouped") == ["grouped", "grouped"]
    assert chosen(experts_implementation="eager") == ["loop", "loop"]
    assert chosen(experts_implementation="grouped_mm") == ["grouped", "grouped"]
    with pytest.raises(ValueError, match="'batched_mm'; pipetrain runs 'grouped_mm' or 'eager'"):
        from_pretrained(tmp_path, [5], experts_implementation="batched_mm")
    with pytest.raises(ValueError, match="not both"):
        from_pretrained(tmp_path, [5], experts="loop", experts_implementation="eager")
    with pytest.raises(ValueError, match="legal: auto, grouped, loop"):
        from_pretrained(tmp_path, [5], experts="fast")
