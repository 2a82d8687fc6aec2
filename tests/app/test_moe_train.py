"""``pipetrain train --model-dir`` on mixture-of-experts folders: a tiny Mixtral folder trains on
2 gloo processes with its config's router loss on by default, and its losses and router losses
equal, in float64, the unsplit ``transformers`` model trained with the same AdamW under gradient
accumulation over the same micro-batches, each MoE layer adding ``router_aux_loss_coef`` × its
family's ``load_balancing_loss_func`` over its micro-batch (the per-layer form of
``pipetrain.hf.router_losses``); what a family cannot run is one line with exit 2 before any
process starts (DeepSeek-V3's multi-token-prediction weights, ``--tp`` on Mixtral, GPT-OSS with
packed documents)."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import torch
from finetune_cases import MOE_COEF, MOE_EXPERTS, MOE_TOP_K, train_args, write_moe_folder

from pipetrain.cli import main

COEF, EXPERTS, TOP_K, M = MOE_COEF, MOE_EXPERTS, MOE_TOP_K, 2


def reference_run(argv: list[str], steps: int) -> tuple[list[float], list[float]]:
    """The unsplit model of the folder trained ``steps`` steps as the pipeline trains it: on the
    same batches, each cut into the same ``M`` micro-batches; the objective the token-mean loss
    over the batch plus, per micro-batch, Σ over MoE layers of ``COEF`` × Mixtral's
    ``load_balancing_loss_func`` on that layer's router logits, averaged over micro-batches.
    Its main losses and router losses per step."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from pipetrain.app.batch_source import train_batches
    from pipetrain.hf import IGNORE_INDEX, causal_lm_token_loss

    config = train_args(*argv)
    model = AutoModelForCausalLM.from_pretrained(
        config.model_dir, dtype=torch.float64, experts_implementation="eager"
    ).train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = train_batches(config, None, M)
    losses, aux_losses = [], []
    for _ in range(steps):
        batch = next(data)
        opt.zero_grad(set_to_none=True)
        count = (batch.targets != IGNORE_INDEX).sum()
        pieces = [torch.tensor_split(t, M) for t in (batch.inputs, batch.targets)]
        sides = {k: torch.tensor_split(v, M) for k, v in batch.side.items()}
        loss = aux = torch.zeros((), dtype=torch.float64)
        for j, (inputs, targets) in enumerate(zip(*pieces, strict=True)):
            side = {k: v[j] for k, v in sides.items()}
            counted = side.pop("token_mask", None)  # packed rows: their pad tail is not counted
            out = model(inputs, use_cache=False, output_router_logits=True, **side)
            loss = loss + causal_lm_token_loss(out.logits, targets) / count
            mask = side.get("attention_mask", counted)
            for logits in out.router_logits:
                aux = aux + COEF * load_balancing_loss_func((logits,), EXPERTS, TOP_K, mask) / M
        (loss + aux).backward()
        opt.step()
        losses.append(loss.item())
        aux_losses.append(aux.item())
    return losses, aux_losses


def test_a_mixtral_folder_trains_with_its_router_loss_as_the_unsplit_model(tmp_path, capfd):
    """2 pipeline ranks (1F1B, a MoE layer on each stage), 2 steps in float64: the metrics'
    loss and ``aux_loss/router_aux_loss`` equal the reference's, the second step after an update
    that the router loss took part in; the launcher names the router loss and its coefficient,
    the report shows the last step's router loss beside its loss."""
    from pipetrain.app.models.data import make_corpus

    folder = write_moe_folder(tmp_path / "mixtral")
    text = tmp_path / "tiny.txt"
    text.write_bytes(make_corpus(2048))
    metrics = tmp_path / "metrics.jsonl"
    argv = [
        "--model-dir",
        folder,
        "--data",
        str(text),
        "--dtype",
        "float64",
        "--seq-len",
        "16",
        "-p",
        "2",
        "-m",
        str(M),
        "--microbatch-size",
        "2",
        "--lr",
        "0.01",
        "--lr-schedule",
        "constant",
        "--warmup",
        "0",
        "--svg",
        str(tmp_path / "step.svg"),
        "--timeout",
        "60",
    ]
    capfd.readouterr()
    status = main(["train", *argv, "--steps", "2", "--metrics", str(metrics)])
    said = capfd.readouterr()
    assert status == 0, said.err
    assert f"router loss on: router_aux_loss_coef {COEF:g}" in said.out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    aux = [r["aux_loss/router_aux_loss"] for r in records]
    assert len(aux) == 2 and all(a > 0 for a in aux), records
    assert "last step:" in said.out and f"router_aux_loss {aux[-1]:.6g}" in said.out
    losses, ref_aux = reference_run(argv, 2)
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-12, abs=0)
    assert aux == pytest.approx(ref_aux, rel=1e-10, abs=0)


def test_the_router_loss_follows_the_flag_and_the_config(tmp_path) -> None:
    """``auto``: the config's coefficient where it is not 0; ``off``: none; a dense folder and
    the built-in models take no ``--router-aux-loss``."""
    from finetune_cases import write_folder
    from transformers import AutoConfig

    from pipetrain.app.model_folder import router_aux_loss_coef, router_line
    from pipetrain.app.train_checks import check_arguments

    folder = write_moe_folder(tmp_path / "mixtral")
    zero = write_moe_folder(tmp_path / "zero", coef=0.0)
    hf = AutoConfig.from_pretrained(folder)
    assert router_aux_loss_coef(train_args("--model-dir", folder), hf) == COEF
    off = train_args("--model-dir", folder, "--router-aux-loss", "off")
    assert router_aux_loss_coef(off, hf) is None
    assert "off (--router-aux-loss off)" in str(router_line(off))
    unset = train_args("--model-dir", zero)
    assert router_aux_loss_coef(unset, AutoConfig.from_pretrained(zero)) is None
    assert "no router_aux_loss_coef other than 0" in str(router_line(unset))
    dense = write_folder(tmp_path / "llama")
    assert router_line(train_args("--model-dir", dense)) is None
    with pytest.raises(ValueError, match="'llama' model, which has no router; drop it"):
        check_arguments(
            train_args("--model-dir", dense, "--seq-len", "16", "--router-aux-loss", "off")
        )
    with pytest.raises(ValueError, match="built-in --model llama has no router"):
        check_arguments(train_args("--router-aux-loss", "off"))


def test_what_a_family_cannot_run_is_refused_before_launching(tmp_path, capsys) -> None:
    """One line, exit 2, nothing launched: DeepSeek-V3 multi-token-prediction weights with the
    reason and the opt-out, ``--tp 2`` on Mixtral
    with the family's, GPT-OSS with packed documents naming ``--packing none``."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config

    deepseek = tmp_path / "deepseek"
    DeepseekV3Config(num_hidden_layers=1).save_pretrained(deepseek)
    mtp = {"model.layers.1.eh_proj.weight": torch.zeros(1)}  # a multi-token-prediction module
    save_file(mtp, str(deepseek / "model.safetensors"))
    mixtral = write_moe_folder(tmp_path / "mixtral")
    gpt_oss = write_moe_folder(tmp_path / "gpt-oss", "gpt_oss")
    cases = {
        (str(deepseek),): "holds DeepSeek-V3 multi-token-prediction weights .* config.json",
        (mixtral, "--tp", "2"): "--tp 2: --model-dir .* holds a 'mixtral' model: --tp with MoE",
        (gpt_oss,): "--packing documents: .*'gpt_oss' model.*give --packing none",
        (gpt_oss, "--packing", "none", "--attention", "sdpa"): "GptOssForCausalLM has no sdpa",
    }
    capsys.readouterr()
    for args, message in cases.items():
        assert main(["train", "--model-dir", *args, "--seq-len", "16"]) == 2, args
        said = capsys.readouterr()
        (line,) = said.err.strip().splitlines()
        assert line.startswith("pipetrain train: error: "), line
        assert re.search(message, line), (message, line)
        assert "launching" not in said.out


def test_every_family_is_a_folder_model_and_the_report_shows_the_terms() -> None:
    """``app.catalog.FOLDER_MODELS`` (torch-free) lists ``pipetrain.hf``'s families; ``auto``
    attention picks a kernel each family's class has; the report's line of the last step's
    extra terms."""
    from pipetrain.app.catalog import FOLDER_MODELS
    from pipetrain.app.model_folder import attention_implementation, causal_lm_class
    from pipetrain.app.report import _extra_line
    from pipetrain.hf.families import SUPPORTED

    assert sorted(FOLDER_MODELS) == sorted(SUPPORTED)
    auto = train_args()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    picked = {
        (t, d.type): attention_implementation(auto, d, causal_lm_class(t))
        for t in ("mixtral", "gpt_oss", "gpt2")
        for d in (cpu, cuda)
    }
    assert picked == {
        ("mixtral", "cpu"): "sdpa",
        ("mixtral", "cuda"): "flex_attention",
        ("gpt_oss", "cpu"): "eager",  # its attention sinks have no SDPA kernel
        ("gpt_oss", "cuda"): "flex_attention",
        ("gpt2", "cpu"): "sdpa",
        ("gpt2", "cuda"): "sdpa",  # no FlexAttention
    }
    line = _extra_line(2.5, {"router_aux_loss": 0.0123456789})
    assert "loss 2.5000  router_aux_loss 0.0123457" in line
