"""``pipetrain train --model-dir`` on a tiny DeepSeek-V3 folder: ``--expert-bias-rate`` checked
and announced before any process starts (refused where the routers have no bias), and, in the
stress tier, 3 steps on 2 gloo processes whose losses equal the unsplit model's trained with the
same AdamW under gradient accumulation and the same bias update after each optimizer step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch
from finetune_cases import tokenizer, train_args
from test_deepseek import build

from pipetrain.cli import main

M, RATE = 2, 0.05


def write_deepseek_folder(folder: Path) -> str:
    """The float64 model of ``test_deepseek`` over the corpus's tokenizer, as a folder."""
    build(vocab_size=64, bos_token_id=2, eos_token_id=0, pad_token_id=1).save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return str(folder)


def test_the_bias_rate_is_checked_and_announced_before_launching(tmp_path, capsys) -> None:
    """The launcher's checks: the rate's line for a DeepSeek-V3 folder (on, or off at 0); the
    flag refused on a dense folder and on the built-in models; a negative rate refused."""
    from finetune_cases import write_folder

    from pipetrain.app.train_checks import check_arguments

    folder = write_deepseek_folder(tmp_path / "deepseek")
    capsys.readouterr()
    check_arguments(train_args("--model-dir", folder, "--seq-len", "16"))
    said = capsys.readouterr().out
    assert "expert bias balancing on: each router's per-expert bias moves by 0.001" in said
    assert "router loss" not in said  # it has none: the bias balances it
    check_arguments(train_args("--model-dir", folder, "--seq-len", "16", "--expert-bias-rate", "0"))
    assert "expert bias balancing off (--expert-bias-rate 0)" in capsys.readouterr().out
    dense = write_folder(tmp_path / "llama")
    with pytest.raises(ValueError, match="'llama' model, whose routers have no per-expert bias"):
        check_arguments(
            train_args("--model-dir", dense, "--seq-len", "16", "--expert-bias-rate", "0.01")
        )
    with pytest.raises(ValueError, match="built-in --model llama, whose routers have no"):
        check_arguments(train_args("--expert-bias-rate", "0.01"))
    with pytest.raises(SystemExit, match="2"):
        main(["train", "--expert-bias-rate", "-1"])
    assert "argument --expert-bias-rate: expected a number >= 0" in capsys.readouterr().err


def reference_losses(argv: list[str], steps: int) -> list[float]:
    """The unsplit model of the folder, trained as the pipeline trains it: the same batches cut
    into the same ``M`` micro-batches, AdamW, then the bias update from the step's loads."""
    from transformers import AutoModelForCausalLM

    import pipetrain
    from pipetrain.app.batch_source import train_batches
    from pipetrain.hf import IGNORE_INDEX, causal_lm_layers, causal_lm_token_loss
    from pipetrain.hf.expert_bias import update_expert_biases

    config = train_args(*argv)
    model = AutoModelForCausalLM.from_pretrained(
        config.model_dir, dtype=torch.float64, experts_implementation="eager"
    ).train()
    (whole,) = pipetrain.split(causal_lm_layers(model), [6])
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = train_batches(config, None, M)
    losses = []
    for _ in range(steps):
        batch = next(data)
        opt.zero_grad(set_to_none=True)
        count = (batch.targets != IGNORE_INDEX).sum()
        pieces = [torch.tensor_split(t, M) for t in (batch.inputs, batch.targets)]
        sides = {k: torch.tensor_split(v, M) for k, v in batch.side.items()}
        loss = torch.zeros((), dtype=torch.float64)
        for j, (inputs, targets) in enumerate(zip(*pieces, strict=True)):
            side = {k: v[j] for k, v in sides.items()}
            loss = loss + causal_lm_token_loss(whole(inputs, **side), targets) / count
        loss.backward()
        opt.step()
        update_expert_biases(whole, RATE)
        losses.append(loss.item())
    return losses


@pytest.mark.stress
def test_a_deepseek_folder_trains_with_the_bias_update_as_the_unsplit_model(tmp_path) -> None:
    from pipetrain.app.models.data import make_corpus

    folder = write_deepseek_folder(tmp_path / "deepseek")
    text = tmp_path / "tiny.txt"
    text.write_bytes(make_corpus(2048))
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        *("--model-dir", folder, "--data", str(text), "--dtype", "float64", "--seq-len", "16"),
        *("-p", "2", "-m", str(M), "--microbatch-size", "2", "--lr", "0.01"),
        *("--lr-schedule", "constant", "--warmup", "0", "--expert-bias-rate", str(RATE)),
        *("--svg", str(tmp_path / "step.svg"), "--timeout", "60"),
    ]
    assert main(["train", *argv, "--steps", "3", "--metrics", str(metrics)]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = reference_losses(argv, 3)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-12, abs=0)
