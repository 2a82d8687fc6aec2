"""Tiny Hugging Face model folders with a tokenizer (no downloads), and per-rank runners for
``pipetrain train --model-dir`` (``test_finetune``).

A folder holds a random float64 model written by ``transformers``' ``save_pretrained`` and a
character-level tokenizer (each character of the corpus one token, a ``<s>`` added in front of
every line) written by ``PreTrainedTokenizerFast.save_pretrained``. The reference is the unsplit
model ``transformers`` loads from the folder, trained with the same AdamW on the same batches
(``app.model_folder.padded_batches``), its loss ``transformers``' own with -100 at the padding.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

VOCAB = 64
#: the corpus's characters (``app.models.data``: sentences and sums)
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .+="


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", bos_token="<s>"
    )


def build(kind: str, blocks: int = 2):
    """A tiny float64 model of ``kind`` (``llama``, or ``gpt2-tied``: GPT-2 with tied
    embeddings), dropout off, the same on every call."""
    import transformers as tf

    if kind == "llama":
        config = tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=blocks,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            bos_token_id=2, eos_token_id=0, pad_token_id=1, tie_word_embeddings=False,
        )  # fmt: skip
        cls = tf.LlamaForCausalLM
    else:
        config = tf.GPT2Config(
            vocab_size=VOCAB, n_embd=16, n_layer=blocks, n_head=4, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=2, eos_token_id=0,
            tie_word_embeddings=True,
        )  # fmt: skip
        cls = tf.GPT2LMHeadModel
    torch.manual_seed(7)
    return cls(config).double()


def write_folder(folder: Path, kind: str = "llama", with_tokenizer: bool = True) -> str:
    build(kind).save_pretrained(folder)
    if with_tokenizer:
        tokenizer().save_pretrained(folder)
    return str(folder)


#: the tiny MoE folders' experts, top-k and router loss coefficient (large, so the router term
#: weighs in the update)
MOE_EXPERTS, MOE_TOP_K, MOE_COEF = 4, 2, 0.25


def write_moe_folder(folder: Path, kind: str = "mixtral", coef: float = MOE_COEF) -> str:
    """A tiny float64 folder of ``kind`` (``mixtral`` or ``gpt_oss``; router loss coefficient
    ``coef``) as a release has it (``output_router_logits`` false), its routers
    drawn wide so that routing is decided, with the corpus's tokenizer."""
    import transformers as tf

    common = dict(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        num_local_experts=MOE_EXPERTS,
        num_experts_per_tok=MOE_TOP_K,
        router_aux_loss_coef=coef,
        output_router_logits=False,
        bos_token_id=2,
        eos_token_id=0,
        pad_token_id=1,
        tie_word_embeddings=False,
    )
    if kind == "mixtral":
        config, cls = tf.MixtralConfig(**common), tf.MixtralForCausalLM
    else:
        config = tf.GptOssConfig(**common, head_dim=4, sliding_window=4)
        cls = tf.GptOssForCausalLM
    torch.manual_seed(7)
    model = cls(config).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight")):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return str(folder)


#: the profile tests' Mixtral folder: vocabulary, hidden size, experts and top-k
PROFILE_MOE = {"vocab": 32, "hidden": 8, "experts": 4, "top_k": 2}


def write_profile_mixtral(folder: Path, seed: int = 0) -> None:
    """A tiny float32 Mixtral folder (``PROFILE_MOE``, no tokenizer) for ``pipetrain profile``."""
    import transformers as tf

    config = tf.MixtralConfig(
        vocab_size=PROFILE_MOE["vocab"],
        hidden_size=PROFILE_MOE["hidden"],
        intermediate_size=12,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        num_local_experts=PROFILE_MOE["experts"],
        num_experts_per_tok=PROFILE_MOE["top_k"],
        router_jitter_noise=0.0,
    )
    torch.manual_seed(seed)
    tf.MixtralForCausalLM(config).save_pretrained(folder)


def train_args(*argv: str):
    from pipetrain.cli.train_command import config_from_argv

    return config_from_argv(argv)


def reference_run(config, steps: int):
    """The unsplit model of ``--model-dir`` trained ``steps`` steps as ``pipetrain train`` does:
    its losses and final state dict."""
    from transformers import AutoModelForCausalLM

    from pipetrain.app.batch_source import train_batches
    from pipetrain.hf import IGNORE_INDEX, causal_lm_token_loss

    model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=torch.float64).train()
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    data = train_batches(config, None, config.microbatches or 4)
    losses = []
    for _ in range(steps):
        batch = next(data)
        opt.zero_grad(set_to_none=True)
        # packed rows: position ids restarting per document and no mask, from which
        # transformers builds the block-diagonal causal mask (with no cache to look at)
        logits = model(batch.inputs, use_cache=False, **batch.side).logits
        # transformers' loss for labels with -100 where nothing is predicted, without its
        # float32 upcast
        count = (batch.targets != IGNORE_INDEX).sum()
        loss = causal_lm_token_loss(logits, batch.targets) / count
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def finetune_runs(rank: int, world: int, directory: str, folders: dict[str, str]) -> dict:
    """``finetune_run`` of each folder (schedule -> folder), in one launch."""
    return {
        schedule: finetune_run(rank, f"{directory}/{schedule}", folder)
        for schedule, folder in folders.items()
    }


def finetune_run(rank: int, directory: str, folder: str) -> dict:
    """``pipetrain train --model-dir`` (float64): 4 steps straight with ``--export``; 2 steps
    with a checkpoint, then a resume to step 4; for the Llama folder, 4 steps with ``--tp 2``.
    Rank 0 also trains the unsplit reference and compares the exports with it."""
    from pipetrain.app.train import train

    schedule = Path(directory).name
    text = Path(directory) / "text.txt"
    if rank == 0:
        from pipetrain.app.models.data import make_corpus

        text.parent.mkdir(parents=True, exist_ok=True)
        text.write_bytes(make_corpus(4096))
    dist.barrier()
    common = ["--model-dir", folder, "--dtype", "float64", "--seq-len", "24", "-s", schedule,
              "-m", "4", "--microbatch-size", "2", "--lr", "0.01", "--lr-schedule", "constant", "--warmup", "0", "--text", str(text), "--svg", f"{directory}/step.svg",
              "--timeout", "60"]  # fmt: skip
    out = f"{directory}/export"
    straight = train(train_args(*common, "--steps", "4", "--export", out), torch.device("cpu"))
    ckpt = ["--checkpoint-dir", f"{directory}/ckpt"]
    train(train_args(*common, *ckpt, "--steps", "2"), torch.device("cpu"))
    resumed = train(train_args(*common, *ckpt, "--steps", "4", "--resume"), torch.device("cpu"))
    differ = [n for n, v in straight.state.items() if not v.equal(resumed.state.get(n, v + 1))]
    result: dict = {
        "straight": straight.losses,
        "resumed": (resumed.first_step, resumed.losses),
        "differ": differ + sorted(resumed.state.keys() - straight.state.keys()),
    }
    if schedule == "1f1b":  # the Llama folder: one stage over 2 tensor-parallel ranks, over 2
        # data-parallel replicas, and dualpipev's V of 4 stages, each on the same packed rows
        tp = ["-p", "1", "--tp", "2", "--steps", "4", "--export", f"{directory}/export-tp"]
        result["tp"] = train(train_args(*common, *tp), torch.device("cpu")).losses
        # 2 replicas of 2 micro-batches: the reference's 4 micro-batches, the same rows
        dp = [*common, "-p", "1", "--dp", "2", "--steps", "4"]
        dp[dp.index("-m") + 1] = "2"
        result["dp"] = train(train_args(*dp), torch.device("cpu")).losses
        v = [*common, "--steps", "4"]
        v[v.index("-s") + 1] = "dualpipev"
        result["dualpipev"] = train(train_args(*v), torch.device("cpu")).losses
    if rank == 0:
        result["reference"], expected = reference_run(train_args(*common), 4)
        result["export_error"] = _export_error(out, expected)
        if schedule == "1f1b":
            result["tp_export_error"] = _export_error(f"{directory}/export-tp", expected)
        result["report"] = straight.report
    return result


def _export_error(out: str, expected: dict[str, torch.Tensor]) -> float:
    """Largest relative difference between the exported folder, as ``transformers`` loads it, and
    the reference's weights (every tensor, tied ones included)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).state_dict()
    assert loaded.keys() == expected.keys(), sorted(loaded.keys() ^ expected.keys())
    return max(
        float((loaded[n] - t).abs().max() / t.abs().max().clamp_min(1e-300))
        for n, t in expected.items()
        if t.is_floating_point()
    )
