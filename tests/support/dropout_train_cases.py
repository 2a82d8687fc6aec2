"""Per-rank runner for ``pipetrain train`` with dropout (``test_train_dropout``): a tiny GPT-2
folder with its default dropout 0.1 (``finetune_cases``' tokenizer), trained in float64 on 2 gloo
processes under two schedules, twice, and 2 steps + ``--resume`` to 4."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def write_dropout_folder(folder: Path, p: float = 0.1) -> str:
    """A GPT-2 folder whose embedding, attention and residual dropouts are ``p``."""
    import transformers as tf
    from finetune_cases import VOCAB, tokenizer

    config = tf.GPT2Config(
        vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32, resid_pdrop=p,
        embd_pdrop=p, attn_pdrop=p, bos_token_id=2, eos_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(7)
    tf.GPT2LMHeadModel(config).double().save_pretrained(folder)
    tokenizer().save_pretrained(folder)
    return str(folder)


def dropout_runs(rank: int, world: int, directory: str, folder: str, plain: str) -> dict:
    """Losses of: 1f1b 4 steps twice; zbv 4 steps; 1f1b 2 steps with a checkpoint, then
    ``--resume`` to 4; the dropout-free folder 1 step (the dropout is active)."""
    from finetune_cases import train_args

    from pipetrain.app.train import train

    text = Path(directory) / "text.txt"
    if rank == 0:
        from pipetrain.app.models.data import make_corpus

        text.write_bytes(make_corpus(2048))
    dist.barrier()

    def run(*args: str, model: str = folder):
        common = ["--model-dir", model, "--dtype", "float64", "--seq-len", "16", "-m", "2",
                  "--microbatch-size", "2", "--lr", "0.01", "--text", str(text), "--timeout", "60",
                  "--seed", "3"]  # fmt: skip
        return train(train_args(*common, *args), torch.device("cpu"))

    ckpt = ["--checkpoint-dir", f"{directory}/ckpt"]
    run(*ckpt, "-s", "1f1b", "--steps", "2")
    resumed = run(*ckpt, "-s", "1f1b", "--steps", "4", "--resume")
    return {
        "1f1b": [run("-s", "1f1b", "--steps", "4").losses for _ in range(2)],
        "zbv": run("-s", "zbv", "--steps", "4").losses,
        "resumed": (resumed.first_step, resumed.losses),
        "plain": run("-s", "1f1b", "--steps", "1", model=plain).losses,
    }
