"""A Llama-3-like decoder from plain torch modules, as a chain of units ``[embed, block 0, ...,
block L-1, head]`` that any cut of the chain is built from (``incumbents.py``'s ``llama`` shapes).

A block: RMSNorm, attention with grouped-query heads (one fused ``qkv`` projection, rotary
position embedding with Llama 3's base 500000, ``scaled_dot_product_attention(is_causal=True,
enable_gqa=True)``), output projection, residual; RMSNorm, SwiGLU MLP (one fused ``gate_up``
projection, ``down``), residual. No biases. The head: RMSNorm and an untied ``Linear(hidden,
vocab)``; the loss is ``lm_loss`` (float32 cross-entropy). Every ``Linear`` is a plain
``nn.Linear``, so pipetrain may defer its weight gradients as on the GPT.

Each unit is built on the device it runs on and initialised there from a generator seeded by its
index (normal 0.02; output projections 0.02 / sqrt(2 L); norms 1), so every library's stages,
whatever the cut, hold the same weights without a CPU copy of an 8-billion-class model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: ``enable_gqa`` came with torch 2.5
_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int
    seq: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    rope_base: float = 500000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def block_params(self) -> int:
        h, d = self.hidden, self.head_dim
        return h * (self.heads + 2 * self.kv_heads) * d + h * h + 3 * h * self.ffn + 2 * h


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split form: ``x [b, heads, t, d]``, ``cos``/``sin [t, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.kv_heads) * d, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg, (b, t, h) = self.cfg, x.shape
        d = cfg.head_dim
        q, k, v = self.qkv(x).split([cfg.heads * d, cfg.kv_heads * d, cfg.kv_heads * d], dim=-1)
        q = rotate(q.view(b, t, cfg.heads, d).transpose(1, 2), cos, sin)
        k = rotate(k.view(b, t, cfg.kv_heads, d).transpose(1, 2), cos, sin)
        v = v.view(b, t, cfg.kv_heads, d).transpose(1, 2)
        if _GQA:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # older torch: repeat the key/value heads
            rep = cfg.heads // cfg.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, h))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.ffn, bias=False)
        self.proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.mlp = SwiGLU(cfg)
        self.register_buffer("cos", torch.empty(cfg.seq, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(cfg.seq, cfg.head_dim), persistent=False)

    def set_rotary(self) -> None:
        d, dev = self.cfg.head_dim, self.cos.device
        inv = self.cfg.rope_base ** (-torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(self.cfg.seq, device=dev, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.cos = angles.cos().to(self.cos.dtype)
        self.sin = angles.sin().to(self.sin.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)  # no-ops but under a cast
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class LlamaEmbed(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tok(ids)


class LlamaHead(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.eps)
        self.out = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def llama_unit(
    cfg: LlamaConfig, index: int, device: torch.device, dtype: torch.dtype, seed: int = 0
) -> nn.Module:
    """Unit ``index`` of the chain (0: the embedding, 1..L: the blocks, L+1: the head), built and
    initialised on ``device`` (module doc)."""
    if not 0 <= index <= cfg.layers + 1:
        raise ValueError(f"unit {index} not in [0, {cfg.layers + 1}]")
    with torch.device("meta"):
        if index == 0:
            unit: nn.Module = LlamaEmbed(cfg)
        elif index <= cfg.layers:
            unit = LlamaBlock(cfg)
        else:
            unit = LlamaHead(cfg)
    unit = unit.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
    out_std = 0.02 / math.sqrt(2 * cfg.layers)
    with torch.no_grad():
        for name, p in unit.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, out_std if name.endswith("proj.weight") else 0.02, generator=gen)
    if isinstance(unit, LlamaBlock):
        unit.set_rotary()
    return unit
