"""Per-rank runners for the documentation's code blocks (``tests/docs``): each block is taken
from the file as written and run as it stands, after a prelude that makes what the text assumes
(a model, a batch; a tiny folder where the text reads a released model's). On the CPU the
blocks' ``"cuda"`` device is ``"cpu"``. ``doc_blocks`` finds every block, and the reason given
for one that is not run (``<!-- not run: REASON -->`` on the line above it)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the documentation whose blocks run: the README and every docs/*.md
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
#: the languages of blocks that run (other blocks show output or file formats)
RUN_LANGUAGES = ("python", "sh", "bash")
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"<!-- not run: (.*) -->")


@dataclass(frozen=True)
class Block:
    """A code block of the documentation: where it is, its code, and why it is not run (None:
    it runs)."""

    doc: str
    line: int
    language: str
    code: str
    not_run: str | None

    @property
    def key(self) -> str:
        """``doc: first line`` (its first line past the imports): how the tests name a block,
        stable while lines move."""
        lines = [line.strip() for line in self.code.splitlines() if line.strip()]
        body = [line for line in lines if not line.startswith(("import ", "from ", "#"))]
        return f"{self.doc}: {(body or lines)[0].split('  #')[0].strip()}"


def doc_blocks() -> list[Block]:
    """Every python, sh and bash block of the README and docs/*.md, in file order."""
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in _FENCE.finditer(text):
            if m.group(1) not in RUN_LANGUAGES:
                continue
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = _NOT_RUN.fullmatch(before.strip())
            line = text.count("\n", 0, m.start()) + 1
            reason = mark.group(1).strip() if mark else None
            found.append(Block(doc, line, m.group(1), m.group(2), reason))
    return found


def block_code(key: str) -> str:
    """The code of the block named ``key`` (``Block.key``)."""
    found = [b.code for b in doc_blocks() if b.key == key]
    if len(found) != 1:
        raise ValueError(f"{len(found)} blocks are named {key!r}")
    return found[0]


def commands(block: Block) -> list[str]:
    """The block's commands, one per line (continuations joined)."""
    joined = block.code.replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip()]


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


#: the python blocks the runners below run, by ``Block.key``
FROM_PLAN = "docs/planning.md: plan = pipetrain.plan(costs, num_ranks=4, memory_gib=60)"
FACTORY_SPLIT = (
    "docs/training.md: stages = pipetrain.split(make_layer, [3, 2, 2, 3], num_layers=10, "
    "init=init_layer)"
)
TENSOR_PARALLEL = (
    'docs/training.md: mesh = init_device_mesh("cuda", (dp, pp, tp), mesh_dim_names=("dp", '
    '"pp", "tp"))'
)
CLOSE_WITH = (
    'docs/runtime.md: with pipetrain.Pipeline(stages, "zbv", num_microbatches=8, '
    "loss_fn=loss_fn) as pipe:"
)
PROFILER = "docs/runtime.md: with profile() as prof:"
LOGGING = 'docs/runtime.md: logging.basicConfig(format="%(asctime)s %(name)s %(message)s")'
FINE_TUNING = (
    'docs/finetuning.md: stages = pipetrain.hf.from_pretrained("Llama-3.2-1B", [5, 5, 5, 4], '
    "dtype=torch.bfloat16,"
)


def _run(key: str, scope: dict) -> dict:
    code = block_code(key).replace('"cuda"', '"cpu"').replace('f"cuda:{local_rank}"', '"cpu"')
    exec(compile(code, key, "exec"), scope)
    return scope


def _tiny_llama(decoder_layers: int, positions: int = 32):
    """A tiny Llama with a released model's layer count (what a cut of it must cover)."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=decoder_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def run_four_rank_blocks(rank: int, world: int, folder: str) -> dict:
    """docs/planning.md's ``from_plan`` block (a uniform 8-layer costs file; the layers as a
    ``{name: layer}`` dict, as the profiler saw them), docs/training.md's factory split (10
    layers, 4 stages) and its tensor-parallel recipe (dp 1 × pp 2 × tp 2, Llama-3.2-1B's 19
    layers, tiny): each steps once; the losses."""
    import torch
    from torch import nn

    import pipetrain

    os.chdir(folder)
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randn(64, 8)  # rows for as many micro-batches as planned
    uniform = {"forward": 1.0, "backward_input": 1.0, "backward_weight": 1.0}
    costs = {"version": 2, "layers": [{**uniform, "activation": 0.1, "params": 0.5}] * 8}
    layers = {f"layers.{i}": nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for i in range(8)}
    scope = {"pipetrain": pipetrain, "costs": costs, "layers": layers, "device": "cpu"}
    scope = _run(FROM_PLAN, {**scope, "loss_fn": nn.functional.mse_loss})
    losses = {"from_plan": float(scope["pipe"].step(x, y))}

    def make_layer(index: int) -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def init_layer(index: int, layer: nn.Module) -> None:
        torch.manual_seed(index)
        for p in layer.parameters():
            nn.init.normal_(p, std=0.3)

    scope = {"pipetrain": pipetrain, "make_layer": make_layer, "init_layer": init_layer}
    scope = _run(FACTORY_SPLIT, {**scope, "loss_fn": nn.functional.mse_loss})
    losses["factory"] = float(scope["pipe"].step(x, y))

    model = _tiny_llama(16)
    scope = _run(TENSOR_PARALLEL, {"model": model, "dp": 1, "pp": 2, "tp": 2})
    tokens = torch.randint(0, 64, (8, 8), generator=torch.Generator().manual_seed(1))
    losses["tensor_parallel"] = float(scope["pipe"].step(tokens, tokens))
    return losses


def run_two_rank_blocks(rank: int, world: int, folder: str) -> dict:
    """docs/runtime.md's ``with Pipeline(...)`` loop and profiler blocks (4 linear stages), and
    docs/finetuning.md's fine-tuning block on a tiny folder named Llama-3.2-1B (its 19 layers) and
    two padded batches: what each left."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipetrain

    os.chdir(folder)
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)]
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    base = {"pipetrain": pipetrain, "torch": torch, "stages": stages}
    base["loss_fn"] = nn.functional.mse_loss
    scope = _run(CLOSE_WITH, {**base, "batches": [(x, y), (x, y)]})
    said = {"closed": scope["pipe"].closed, "loss": float(scope["loss"])}
    with pipetrain.Pipeline(stages, "zbv", 8, nn.functional.mse_loss) as pipe:
        scope = _run(PROFILER, {"pipe": pipe, "inputs": x, "targets": y})
    said["profiled"] = len(scope["prof"].key_averages()) > 0

    if rank == 0:
        _tiny_llama(16).save_pretrained("Llama-3.2-1B")
    dist.barrier()
    g = torch.Generator().manual_seed(2)
    mask = torch.ones(8, 6, dtype=torch.long)
    mask[:4, -2:] = 0  # right padding
    data = [(torch.randint(0, 64, (8, 6), generator=g), mask) for _ in range(2)]
    scope = _run(FINE_TUNING, {"data": data, "local_rank": rank})
    said["fine_tuned"] = float(scope["loss"])
    said["exported"] = os.path.isfile("Llama-3.2-1B-tuned/config.json")
    return said
