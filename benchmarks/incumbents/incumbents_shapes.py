"""The models ``incumbents.py`` trains, and how each library's stages are cut from them.

Every model is a chain of *units*: ``[embed, block 0, ..., block L-1, head]`` (the ``gpt`` and
``llama`` kinds) or ``[block 0, ..., block L-1]`` (``blocks``: pre-norm blocks on hidden states,
MSE against random targets). A *cut* gives each stage of the chain a count of units, and a stage
is those units in a row (``Chain``), each unit a copy of one seeded master (``UnitBank``): any two
libraries with the same cut run the same modules with the same weights.

Cuts: ``uniform`` (the ``gpt`` and ``blocks`` shapes, every library alike): blocks as even as
``stage_layers`` makes them, the embedding on the first stage and the head on the last.
``account`` (the ``llama`` shapes, for the incumbents): the embedding and the head each count as
one layer and every stage gets the same number of units, which is Megatron-Core's
``account_for_embedding_in_pipeline_split`` + ``account_for_loss_in_pipeline_split`` (the
Megatron runner checks this cut against Megatron's own ``get_num_layers_to_build``); pipetrain
gets the cut ``pipetrain.planner`` picks for the row's schedule from the shape's costs
(``planner_cut``).
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from torch import nn

from benchmarks.common.gpu_setup import local_stages
from benchmarks.incumbents.incumbents_llama import LlamaConfig, llama_unit
from pipetrain.app.models.gpt import GPTConfig, GPTStage, gpt_layer, lm_loss, stage_layers

GIB = 2**30


@dataclass(frozen=True)
class Fam:
    """A schedule family as every library is asked to run it: torch's class, the stages per
    rank of pipetrain's row, and how stages sit on ranks (``one``, ``loop``, ``v``)."""

    torch_class: str
    v: int
    layout: str


FAMS = {
    "1f1b": Fam("Schedule1F1B", 1, "one"),
    # torch's ZB-H1: its interleaved zero-bubble schedule (ZB1P) with one stage per rank
    "zb-h1": Fam("ScheduleInterleavedZeroBubble", 1, "one"),
    "interleaved-1f1b": Fam("ScheduleInterleaved1F1B", 2, "loop"),
    "interleaved-zb": Fam("ScheduleInterleavedZeroBubble", 2, "loop"),
    "zbv": Fam("ScheduleZBVZeroBubble", 2, "v"),
    "dualpipev": Fam("ScheduleDualPipeV", 2, "v"),
}


@dataclass(frozen=True)
class Shape:
    name: str
    kind: str  # gpt | blocks | llama
    layers: int
    hidden: int
    heads: int
    seq: int
    mb_size: int
    vocab: int = 8192
    kv_heads: int = 0
    ffn: int = 0
    cut: str = "uniform"  # the incumbents' cut: uniform | account

    @property
    def units(self) -> int:
        return self.layers + (0 if self.kind == "blocks" else 2)

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            seq_len=self.seq,
            num_layers=self.layers,
            hidden=self.hidden,
            num_heads=self.heads,
        )

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(
            self.vocab, self.seq, self.layers, self.hidden, self.heads, self.kv_heads, self.ffn
        )

    @property
    def loss(self):
        return mse_loss if self.kind == "blocks" else lm_loss

    def batch(self, device, dtype, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1234 + n)
        b = n * self.mb_size
        if self.kind == "blocks":
            x = torch.randn(b, self.seq, self.hidden, generator=g).to(dtype)
            y = torch.randn(b, self.seq, self.hidden, generator=g).to(dtype)
        else:
            x = torch.randint(0, self.vocab, (b, self.seq), generator=g)
            y = torch.randint(0, self.vocab, (b, self.seq), generator=g)
        return x.to(device), y.to(device)

    def block_params(self) -> int:
        if self.kind == "llama":
            return self.llama_config().block_params()
        h = self.hidden
        return 4 * h * h + 4 * h + 2 * 4 * h * h + 5 * h + 4 * h

    def head_params(self) -> int:
        return 0 if self.kind == "blocks" else self.hidden * self.vocab + 2 * self.hidden

    def flops_per_token(self) -> float:
        """6·P + 12·L·s·h, P = parameters except embeddings (the Megatron/PaLM convention)."""
        params = self.layers * self.block_params() + self.head_params()
        return 6 * params + 12 * self.layers * self.seq * self.hidden


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


def _llama(name: str, layers: int, **kw) -> Shape:
    return Shape(name, "llama", layers, cut="account", **kw)


LLAMA8B = dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096, mb_size=1, vocab=128256)
SHAPES = {
    # docs/benchmarks.md's GPT: 16 layers × hidden 2048, seq 1024, vocabulary 8192, micro-batch 4
    "gpt": Shape("gpt", "gpt", layers=16, hidden=2048, heads=16, seq=1024, mb_size=4),
    # docs/incumbents.md's block stack: 16 pre-norm blocks, hidden 2048, 16 heads, seq 1024, MSE
    "blocks": Shape("blocks", "blocks", layers=16, hidden=2048, heads=16, seq=1024, mb_size=4),
    # wide and long: transfers of 32 MiB per micro-batch
    "wide": Shape("wide", "gpt", layers=8, hidden=4096, heads=32, seq=4096, mb_size=1),
    # Llama-3-8B's blocks (GQA 32/8 heads, SwiGLU 14336, RMSNorm, RoPE, vocabulary 128256, seq
    # 4096): 8 of its 32 layers on 2 ranks (10 units: Megatron's rule gives 5 per rank), 10 on 4
    "llama": _llama("llama", 8, **LLAMA8B),
    "llama-x4": _llama("llama-x4", 10, **LLAMA8B),
    # CPU smoke shapes
    "gpt-tiny": Shape("gpt-tiny", "gpt", layers=8, hidden=64, heads=4, seq=32, mb_size=2, vocab=97),
    "blocks-tiny": Shape("blocks-tiny", "blocks", layers=8, hidden=64, heads=4, seq=32, mb_size=2),
    "wide-tiny": Shape(
        "wide-tiny", "gpt", layers=8, hidden=64, heads=8, seq=128, mb_size=1, vocab=97
    ),
    # 6 layers: 8 units, 4 per rank on 2 ranks (Megatron's interleaving at 2 and 4 chunks)
    "llama-tiny": _llama(
        "llama-tiny", 6, hidden=64, heads=4, kv_heads=2, ffn=96, seq=32, mb_size=2, vocab=97
    ),
}


# ---------------------------------------------------------------------------------------------
# cuts
# ---------------------------------------------------------------------------------------------


def uniform_cut(shape: Shape, num_stages: int) -> tuple[int, ...]:
    """Blocks as even as ``stage_layers`` makes them; embedding first, head last (module doc)."""
    counts = [b - a for a, b in stage_layers(shape.layers, num_stages)]
    if shape.kind != "blocks":
        counts[0] += 1
        counts[-1] += 1
    return tuple(counts)


def account_cut(shape: Shape, num_stages: int) -> tuple[int, ...]:
    """Megatron's account-for-embedding-and-loss rule: every stage the same number of units
    (where they do not divide evenly, which Megatron refuses, the leftover units go to the
    middle stages, as ``stage_layers`` hands out blocks: the torch and DeepSpeed rows)."""
    return tuple(b - a for a, b in stage_layers(shape.units, num_stages))


def incumbent_cut(shape: Shape, num_stages: int) -> tuple[int, ...]:
    """The incumbents' cut of ``shape`` into ``num_stages`` stages (module doc)."""
    if shape.cut == "account":
        return account_cut(shape, num_stages)
    return uniform_cut(shape, num_stages)


def interleave_options(shape: Shape, ranks: int) -> list[int]:
    """Megatron's virtual-stage counts the layers allow: ``v >= 2`` dividing the layers per rank
    (units per rank under the ``account`` cut)."""
    total = shape.units if shape.cut == "account" else shape.layers
    if total % ranks:
        return []
    per_rank = total // ranks
    return [v for v in range(2, per_rank + 1) if per_rank % v == 0]


def analytic_costs(
    shape: Shape, tflops: float = 400.0, link_gbs: float = 100.0, hbm_gbs: float = 2000.0
) -> dict:
    """A costs file (docs/planning.md, version 2) from FLOP and byte counts: per unit and
    micro-batch, forward = matrix FLOPs (+ causal attention) at ``tflops``, backward input as
    much again (attention twice), backward weight the matrix FLOPs; the loss adds four passes
    over the float32 logits at ``hbm_gbs`` to the head's forward and backward; activations and
    static memory (bf16 parameters, gradients and two AdamW states) counted from the shapes."""
    tok = shape.mb_size * shape.seq
    h, ms = shape.hidden, 1e3 / (tflops * 1e12)
    loss_ms = 4 * tok * shape.vocab * 4 / (hbm_gbs * 1e9) * 1e3
    attn = 2 * tok * shape.seq * h  # QKᵀ and AV, causal: half of 4·s²·h
    width = 6 * h + shape.ffn * 3 + (shape.kv_heads or shape.heads) * 2 * (h // shape.heads)
    layers = []
    for i in range(shape.units):
        head = shape.kind != "blocks" and i == shape.units - 1
        embed = shape.kind != "blocks" and i == 0
        params = shape.head_params() if head else shape.block_params()
        mm = 0 if embed else 2 * tok * params
        act = 2 * tok * (2 * h + 3 * shape.vocab) if head else 2 * tok * width
        layers.append(
            {
                "name": "embed" if embed else "head" if head else f"block{i}",
                "forward": (mm + (0 if embed or head else attn)) * ms + loss_ms * head,
                "backward_input": (mm + (0 if embed or head else 2 * attn)) * ms + loss_ms * head,
                "backward_weight": (2 * tok * h if embed else mm) * ms,
                "activation": (tok * 8 if embed else act) / GIB,
                "params": 8 * (shape.vocab * h if embed else params) / GIB,
            }
        )
    return {
        "version": 2,
        "layers": layers,
        "comm": 2 * tok * h / (link_gbs * 1e9) * 1e3,
        "meta": {"source": "incumbents_shapes.analytic_costs", "tflops": tflops},
    }


def planner_cut(costs, schedule: str, ranks: int, v: int, n: int, memory_gib: float) -> tuple:
    """The cut ``pipetrain.planner`` picks for this schedule, stages per rank and micro-batch
    count from ``costs`` (a costs dict or ``ModelCosts``)."""
    from pipetrain.planner import search
    from pipetrain.planner.search import as_costs

    found = search(
        as_costs(costs),
        num_ranks=ranks,
        memory_gib=memory_gib,
        microbatches=[n],
        schedules=[schedule],
        stages_per_rank=[v],
    )
    return tuple(found.best.plan.stage_layers)


# ---------------------------------------------------------------------------------------------
# stages
# ---------------------------------------------------------------------------------------------


class Chain(nn.Sequential):
    """One stage: its units in a row."""


def unit_ranges(cut: tuple[int, ...]) -> list[range]:
    ends = [sum(cut[: s + 1]) for s in range(len(cut))]
    return [range(e - c, e) for c, e in zip(cut, ends)]


class UnitBank:
    """The units every library's stages are copied from. ``gpt`` and ``blocks`` units: one
    seeded master each on the CPU in the run's dtype, deep-copied to the device per stage (the
    same weights as ``pipetrain.app.models.gpt``'s unsplit model); ``llama`` units: built and
    seeded on the device each time (``incumbents_llama``)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._masters: dict[tuple[str, int], nn.Module] = {}

    def unit(self, shape: Shape, i: int) -> nn.Module:
        if shape.kind == "llama":
            return llama_unit(shape.llama_config(), i, self.device, self.dtype)
        key = (shape.name, i)
        if key not in self._masters:
            cfg = shape.gpt_config()
            if shape.kind == "blocks":
                master: nn.Module = GPTStage(cfg, i, i + 1, embed=False, head=False, seed=0)
            else:
                master = gpt_layer(cfg, i, seed=0)
            self._masters[key] = master.to(self.dtype)
        return copy.deepcopy(self._masters[key]).to(self.device)

    def stage(self, shape: Shape, cut: tuple[int, ...], s: int) -> Chain:
        return Chain(*(self.unit(shape, i) for i in unit_ranges(cut)[s]))


@dataclass(frozen=True)
class Row:
    """One measurement: ``lib`` running ``schedule`` (a pipetrain family name; Megatron's
    interleaved rows carry their own ``v``) on ``shape`` with ``n`` micro-batches, stages cut by
    ``cut`` (unit counts of all ``v × ranks`` stages, in chain order)."""

    shape: Shape
    schedule: str
    n: int
    lib: str
    v: int
    cut: tuple[int, ...]

    @property
    def layout(self) -> str:
        return FAMS[self.schedule].layout

    @property
    def num_stages(self) -> int:
        return len(self.cut)

    def local(self, rank: int, world: int) -> list[int]:
        return local_stages(self.layout, rank, world, self.v)

    @property
    def tokens(self) -> int:
        return self.n * self.shape.mb_size * self.shape.seq


def memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GIB
    return 24.0
