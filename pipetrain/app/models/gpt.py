"""A small, standard GPT and its cut into pipeline stages.

The model: token embedding + learned positions, pre-LN decoder blocks (causal self-attention via
``scaled_dot_product_attention``, then a GELU MLP), final LayerNorm and an untied LM head. No
dropout unless asked for.

Every stage is a ``GPTStage`` holding a contiguous run of blocks; the first also holds the
embeddings, the last the final LayerNorm and head, and the whole model is the one-stage case, so
the split and the unsplit model are the same code. Blocks are stored under their *global* layer
index (``blocks.5.attn.qkv.weight`` whatever the cut), so state dicts are keyed by layer, not by
pipeline layout, and the union of the stages' state dicts is the whole model's. Each parameter
group is initialised from its own generator seeded by ``(seed, layer)``, so a rank that builds only
its own stages gets exactly the weights the unsplit model has.

Stage boundaries pass one tensor: token ids ``[b, t]`` into the first stage, the hidden state
``[b, t, hidden]`` between stages, logits ``[b, t, vocab]`` out of the last.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

#: generator offsets for the non-block parts (blocks use their layer index)
_EMBED_SEED, _HEAD_SEED = 1_000_001, 1_000_002


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64  # longest sequence (number of learned positions)
    num_layers: int = 8
    hidden: int = 64
    num_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "num_layers", "hidden", "num_heads", "mlp_ratio"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be an integer >= 1, got {value!r}")
        if self.hidden % self.num_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be a multiple of num_heads ({self.num_heads})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, h // self.num_heads).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [b, heads, t, head_dim]
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.mlp_ratio * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LN decoder block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPTStage(nn.Module):
    """Blocks ``[first_layer, last_layer)``, with the embeddings if ``embed`` and the final
    LayerNorm and head if ``head``. The whole model is ``GPTStage(cfg, 0, L, embed=True,
    head=True)`` (see ``build_gpt``)."""

    def __init__(
        self,
        cfg: GPTConfig,
        first_layer: int,
        last_layer: int,
        *,
        embed: bool,
        head: bool,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if not 0 <= first_layer <= last_layer <= cfg.num_layers:
            raise ValueError(
                f"layers [{first_layer}, {last_layer}) are not within [0, {cfg.num_layers})"
            )
        self.config, self.first_layer, self.last_layer = cfg, first_layer, last_layer
        if embed:
            self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
            self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(first_layer, last_layer)})
        if head:
            self.ln_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
            self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.has_embed, self.has_head = embed, head
        self._init(seed)

    @torch.no_grad()
    def _init(self, seed: int) -> None:
        """GPT-2 init, each part from its own seeded generator (independent of the cut)."""
        std, proj_std = 0.02, 0.02 / math.sqrt(2 * self.config.num_layers)
        parts: list[tuple[int, nn.Module]] = [(int(i), b) for i, b in self.blocks.items()]
        if self.has_embed:
            parts.insert(0, (_EMBED_SEED, nn.ModuleList([self.tok_emb, self.pos_emb])))
        if self.has_head:
            parts.append((_HEAD_SEED, nn.ModuleList([self.ln_f, self.head])))
        for offset, module in parts:
            gen = torch.Generator().manual_seed(seed * 10_000_019 + offset)
            for name, p in module.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif p.dim() == 1:  # LayerNorm weight
                    p.fill_(1.0)
                else:
                    s = proj_std if name.endswith("proj.weight") else std
                    p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_embed:
            t = x.shape[1]
            if t > self.config.seq_len:
                raise ValueError(f"sequence length {t} exceeds seq_len {self.config.seq_len}")
            pos = torch.arange(t, device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.has_head:
            x = self.head(self.ln_f(x))
        return x

    def extra_repr(self) -> str:
        parts = ["embed"] if self.has_embed else []
        parts.append(f"layers {self.first_layer}..{self.last_layer - 1}")
        if self.has_head:
            parts.append("head")
        return ", ".join(parts)


def gpt_layer(cfg: GPTConfig, index: int, seed: int = 0) -> GPTStage:
    """Layer ``index`` of the model as a chain ``[embed, block 0, ..., block L-1, head]``: the
    embedding and the head (with the final LayerNorm) are layers of their own, so a planner sees
    how heavy they are. Weights as in the unsplit model (each part seeded by its layer)."""
    n = cfg.num_layers
    if not 0 <= index <= n + 1:
        raise ValueError(f"layer index {index} not in [0, {n + 1}]")
    if index == 0:
        return GPTStage(cfg, 0, 0, embed=True, head=False, seed=seed)
    if index <= n:
        return GPTStage(cfg, index - 1, index, embed=False, head=False, seed=seed)
    return GPTStage(cfg, n, n, embed=False, head=True, seed=seed)


def gpt_layer_names(cfg: GPTConfig) -> list[str]:
    return ["embed", *(f"block{i}" for i in range(cfg.num_layers)), "head"]


def gpt_layers(cfg: GPTConfig, seed: int = 0) -> list[GPTStage]:
    """The model as a chain of layers (``gpt_layer``): embedding, each block, head."""
    return [gpt_layer(cfg, i, seed) for i in range(cfg.num_layers + 2)]


def gpt_stage(cfg: GPTConfig, stage_layers: Sequence[int], stage: int, seed: int = 0) -> GPTStage:
    """Stage ``stage`` of the cut ``stage_layers`` of ``gpt_layers`` (layer counts per stage, as
    a plan gives them)."""
    if sum(stage_layers) != cfg.num_layers + 2 or min(stage_layers) < 1:
        raise ValueError(
            f"stage_layers {list(stage_layers)} must be counts >= 1 summing to "
            f"{cfg.num_layers + 2} (embedding, {cfg.num_layers} blocks, head)"
        )
    ends = list(accumulate(stage_layers))
    first, end = ends[stage] - stage_layers[stage], ends[stage]
    # list positions 1..L are blocks 0..L-1; position 0 the embedding, L+1 the head
    blocks = (max(first, 1) - 1, min(end, cfg.num_layers + 1) - 1)
    return GPTStage(
        cfg, blocks[0], blocks[1], embed=first == 0, head=end == cfg.num_layers + 2, seed=seed
    )


def build_gpt(cfg: GPTConfig, seed: int = 0) -> GPTStage:
    """The whole, unsplit model."""
    return GPTStage(cfg, 0, cfg.num_layers, embed=True, head=True, seed=seed)


def stage_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """``[first, last)`` layer ranges per stage: as even as possible, every stage at least one
    block; leftover blocks go to the middle stages first, since the first and last stages also
    carry the embeddings and the head."""
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be an integer >= 1, got {num_stages!r}")
    if num_stages > num_layers:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_stages} stages: every stage needs at least "
            f"one block; use num_stages <= {num_layers} or more layers"
        )
    base, extra = divmod(num_layers, num_stages)
    # middle stages first (outward from the centre), then the ends
    order = sorted(
        range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(2 * s - num_stages + 1))
    )
    counts = [base + (s in order[:extra]) for s in range(num_stages)]
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def make_stage(cfg: GPTConfig, stage_index: int, num_stages: int, seed: int = 0) -> GPTStage:
    """Stage ``stage_index`` of ``num_stages``; identical to ``split_gpt(...)[stage_index]``."""
    bounds = stage_layers(cfg.num_layers, num_stages)
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index must be in [0, {num_stages}), got {stage_index}")
    first, last = bounds[stage_index]
    return GPTStage(
        cfg, first, last, embed=stage_index == 0, head=stage_index == num_stages - 1, seed=seed
    )


def split_gpt(cfg: GPTConfig, num_stages: int, seed: int = 0) -> list[GPTStage]:
    """The model cut into ``num_stages`` balanced stages (see ``stage_layers``)."""
    return [make_stage(cfg, s, num_stages, seed) for s in range(num_stages)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: ``logits [b, t, vocab]``, ``targets [b, t]``."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax over the vocabulary in low precision loses too much
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1))
