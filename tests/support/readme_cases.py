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


def run_api_block(dtype_name: str) -> list[tuple[int, str]]:
    """README's first training block, as written, in 2 fresh processes (the block initialises
    the process group itself, as under torchrun; "nccl" is "gloo" on the CPU): each rank's exit
    status and the end of its output."""
    import subprocess
    import sys

    from runtime_harness import free_port

    prelude = (
        "import torch\n"
        "from torch import nn\n"
        f"torch.set_default_dtype(torch.{dtype_name})\n"
        "torch.manual_seed(0)\n"
        "stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]\n"
        "loss_fn = nn.functional.mse_loss\n"
        "inputs, targets = torch.randn(16, 8), torch.randn(16, 8)\n"
    )
    block = code_block("README.md", "## The Python API").replace('"nccl"', '"gloo"')
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env |= {"WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", prelude + block],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    return [(p.wait(timeout=180), p.stdout.read()[-2000:]) for p in procs]  # type: ignore[union-attr]


def run_training_guide_block(rank: int, world: int, dtype_name: str, folder: str) -> dict:
    """docs/training.md's first block: its ``Embed``, ``Block``, ``Head``, ``L`` and ``data``
    made here (a token embedding, residual MLP blocks that take the attention mask, a vocabulary
    head), two steps; the losses and the checkpoint it wrote."""
    import torch
    from torch import nn

    dtype = getattr(torch, dtype_name)
    torch.set_default_dtype(dtype)
    torch.manual_seed(0)

    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(32, 16)

        def forward(self, tokens):
            return self.emb(tokens)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 16)

        def forward(self, h, attention_mask=None):
            return h + torch.tanh(self.lin(h)) * attention_mask.unsqueeze(-1).to(h.dtype)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out = nn.Linear(16, 32)

        def forward(self, h):
            return self.out(h)

    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(2):
        tokens = torch.randint(0, 32, (8, 6), generator=g)
        targets = torch.randint(0, 32, (8, 6), generator=g)
        mask = torch.ones(8, 6, dtype=torch.long)
        mask[:, -2:] = 0  # right padding, not predicted
        data.append((tokens, targets.masked_fill(mask == 0, -100), mask))
    os.chdir(folder)
    block = code_block("docs/training.md", "# Training a real model with pipetrain")
    scope: dict = {"Embed": Embed, "Block": Block, "Head": Head, "L": 8, "data": data}
    exec(compile(block, "docs/training.md: the first block", "exec"), scope)
    return {"loss": float(scope["loss"]), "saved": os.path.isdir("ckpt/0")}
