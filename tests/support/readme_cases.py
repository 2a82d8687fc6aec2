"""Per-rank runners for the documentation's code blocks (``tests/docs``): each block is taken
from the file as written and run as it stands, after a prelude that makes what the text assumes
(a model, a batch). On the CPU the blocks' ``"cuda"`` device is ``"cpu"``."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def code_block(doc: str, heading: str, language: str = "python") -> str:
    """The first ``language`` code block after the line ``heading`` in ``doc``."""
    text = (ROOT / doc).read_text()
    start = text.index(heading + "\n")
    found = re.search(rf"```{language}\n(.*?)```", text[start:], re.S)
    if found is None:
        raise ValueError(f"no {language} block after {heading!r} in {doc}")
    return found.group(1)


def run_training_job(rank: int, world: int, dtype_name: str, folder: str) -> dict:
    """README's "A training job": a tiny Llama (7 decoder layers: 10 layers to cut), each
    data-parallel replica its own 8 rows; the loss and the checkpoint it wrote."""
    import torch
    import transformers

    dtype = getattr(torch, dtype_name)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    g = torch.Generator().manual_seed(rank // 2)  # the replica's rows (mesh (dp, pp) = (2, 2))
    tokens = torch.randint(0, 64, (8, 16), generator=g)
    targets = torch.randint(0, 64, (8, 16), generator=g)
    os.chdir(folder)
    block = code_block("README.md", "### A training job").replace('"cuda"', '"cpu"')
    scope: dict = {"model": model, "tokens": tokens, "targets": targets}
    exec(compile(block, "README.md: A training job", "exec"), scope)
    loss = scope["loss"]
    return {"loss": float(loss), "dtype": str(loss.dtype), "saved": os.path.isdir("ckpt/100")}
