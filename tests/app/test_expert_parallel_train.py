"""``pipetrain train --model-dir DIR --ep E``: a tiny Mixtral folder trains on a pp 2 × dp 2 mesh
with its experts sharded over ep 2, its losses and router losses equal in float64 to the unsplit
``transformers`` model trained with the same AdamW under gradient accumulation over every
replica's micro-batches; what expert parallel cannot run is one line before any process starts."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch
from finetune_cases import MOE_COEF, MOE_EXPERTS, MOE_TOP_K, train_args, write_moe_folder

from pipetrain.cli import main

COEF, EXPERTS, TOP_K, M, DP = MOE_COEF, MOE_EXPERTS, MOE_TOP_K, 2, 2


def reference_run(argv: list[str], steps: int) -> tuple[list[float], list[float]]:
    """The unsplit model trained as the pipeline's replicas together train it: each step's
    batch (every replica's rows) cut into ``DP × M`` micro-batches, replica by replica; the
    token-mean loss over the batch plus ``COEF`` × each MoE layer's balancing loss per
    micro-batch, averaged over them. With ``--compile`` its decoder layers and final norm are
    compiled as ``train`` compiles them: transformers' RMSNorm rounds a float64 input to
    float32, a cast inductor leaves out, so the eager model is the wrong reference for it."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from pipetrain.app.batch_source import train_batches
    from pipetrain.hf import IGNORE_INDEX, causal_lm_token_loss

    config = train_args(*argv)
    model = AutoModelForCausalLM.from_pretrained(
        config.model_dir, dtype=torch.float64, experts_implementation="eager"
    ).train()
    if config.compile:
        for module in (*model.model.layers, model.model.norm):
            module.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = train_batches(config, None, M)
    losses, aux_losses = [], []
    for _ in range(steps):
        batch = next(data)
        opt.zero_grad(set_to_none=True)
        count = (batch.targets != IGNORE_INDEX).sum()
        pieces = [torch.tensor_split(t, DP * M) for t in (batch.inputs, batch.targets)]
        sides = {k: torch.tensor_split(v, DP * M) for k, v in batch.side.items()}
        loss = aux = torch.zeros((), dtype=torch.float64)
        for j, (inputs, targets) in enumerate(zip(*pieces, strict=True)):
            side = {k: v[j] for k, v in sides.items()}
            counted = side.pop("token_mask", None)  # packed rows: their pad tail is not counted
            out = model(inputs, use_cache=False, output_router_logits=True, **side)
            loss = loss + causal_lm_token_loss(out.logits, targets) / count
            mask = side.get("attention_mask", counted)
            for logits in out.router_logits:
                term = load_balancing_loss_func((logits,), EXPERTS, TOP_K, mask)
                aux = aux + COEF * term / (DP * M)
        (loss + aux).backward()
        opt.step()
        losses.append(loss.item())
        aux_losses.append(aux.item())
    return losses, aux_losses


@pytest.mark.stress  # 4 processes that each load transformers and tokenize: ~40 s on 2 cores
@pytest.mark.slow
@pytest.mark.parametrize("kernels", [(), ("--compile",)], ids=["eager", "compiled"])
def test_a_mixtral_folder_trains_with_ep_2_as_the_unsplit_model(tmp_path, capfd, kernels) -> None:
    """pp 2 × dp 2 with ep 2 (4 processes, zbv), 2 steps: the second after an AdamW update of
    the sharded experts; losses to 1e-10, router losses to float32's resolution (transformers'
    balancing function computes in float32). Compiled, each layer is one ``torch.compile`` region
    that breaks its graph at the dispatch's all-to-all, and still trains as the eager model."""
    from pipetrain.app.models.data import make_corpus

    folder = write_moe_folder(tmp_path / "mixtral")
    text = tmp_path / "tiny.txt"
    text.write_bytes(make_corpus(2048))
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        *("--model-dir", folder, "--data", str(text), "--dtype", "float64"),
        *("--seq-len", "16", "-p", "2", "-s", "zbv", "-m", str(M), "--microbatch-size", "1"),
        *("--dp", str(DP), "--ep", "2"),  # FSDP2, the default, for the dense parameters
        *("--lr", "0.01", "--lr-schedule", "constant", "--warmup", "0"),
        *("--microbatch-balance", "fixed", "--timeout", "60"),
        *kernels,
    ]
    capfd.readouterr()
    status = main(["train", *argv, "--steps", "2", "--metrics", str(metrics)])
    said = capfd.readouterr()
    assert status == 0, said.err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses, aux = reference_run(argv, 2)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-10, abs=0)
    recorded = [r["aux_loss/router_aux_loss"] for r in records]
    assert recorded == pytest.approx(aux, rel=1e-6, abs=0)


def test_what_expert_parallel_cannot_run_is_refused_before_launching(tmp_path, capsys) -> None:
    """One line, exit 2, nothing launched: an ep that does not divide --dp or the experts, a
    dense folder or built-in model, --tp > 1."""
    from finetune_cases import write_folder

    from pipetrain.app.train_checks import check_arguments

    mixtral = write_moe_folder(tmp_path / "mixtral")
    dense = write_folder(tmp_path / "llama")
    common = ("--seq-len", "16")
    cases = {
        ("--model-dir", mixtral, "--dp", "3", "--ep", "2"): r"--ep 2 must divide --dp 3",
        ("--model-dir", mixtral, "--dp", "3", "--ep", "3"): r"divide the number of experts \(4",
        ("--model-dir", dense, "--dp", "2", "--ep", "2"): r"dense 'llama' model.*drop --ep",
        ("--dp", "2", "--ep", "2"): "built-in --model .* is dense: drop --ep",
        ("--model-dir", mixtral, "--dp", "2", "--ep", "2", "--tp", "2"): "expert tensor parallel",
    }
    for flags, message in cases.items():
        with pytest.raises(ValueError, match=message):
            check_arguments(train_args(*flags, *common))
    capsys.readouterr()
    assert main(["train", "--model-dir", mixtral, "--dp", "3", "--ep", "2", *common]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--ep 2 must divide --dp 3" in err, err
