"""The wrappers that let a ``transformers`` decoder layer run alone, as a pipeline layer.

A ``transformers`` model computes once, in its ``forward``, what every layer needs: position ids,
the rotary table (Llama family), the attention mask. Cut into stages those would have to be
threaded through every stage's outputs. Each wrapper here makes its own from the hidden states it
receives and the side inputs it is given (``attention_mask``, ``position_ids``;
``pipetrain.hf.masks``) — exactly what the unsplit ``forward`` computes from the same inputs,
built by the first layer of a stage that needs it and reused by the next (``masks.BuiltOnce``).

A wrapper registers the wrapped layer's children as its own (``_Adopting``), so parameter names
are the model's (``model.layers.3.self_attn.q_proj.weight``) and a ``transformers`` checkpoint
loads by name whatever the cut. Which wrapper a model type gets is a row of
``pipetrain.hf.families``; each wrapper carries its row as ``family``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipetrain.hf import masks


class _Adopting(nn.Module):
    """Registers a ``transformers`` layer's children as its own (same objects, so parameter
    names drop the wrapper level) and keeps the layer unregistered, to call it."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        if (
            next(layer.parameters(recurse=False), None) is not None
            or next(layer.buffers(recurse=False), None) is not None
        ):
            raise ValueError(
                f"{type(layer).__name__} holds parameters or buffers of its own; only layers "
                "whose state sits in submodules can be wrapped"
            )
        for name, child in layer.named_children():
            self.add_module(name, child)
        self._wrapped = (layer,)  # a tuple: not registered as a submodule
        self.train(layer.training)

    @property
    def wrapped(self) -> nn.Module:
        return self._wrapped[0]

    def train(self, mode: bool = True):
        super().train(mode)
        self.wrapped.training = mode  # the layer reads it (gradient checkpointing)
        return self


class DecoderLayer(_Adopting):
    """A Llama-family decoder layer that computes its own position ids, rotary table and mask
    (or takes them from the layer before it in the same micro-batch: ``shared``)."""

    #: the layer's row of ``pipetrain.hf.families`` (set by the family's builder)
    family: Any = None

    def __init__(
        self,
        layer: nn.Module,
        rotary_emb: nn.Module,
        config,
        index: int,
        shared: masks.BuiltOnce | None = None,
    ) -> None:
        super().__init__(layer)
        self.shared = shared if shared is not None else masks.BuiltOnce()
        self.rotary_emb = rotary_emb  # buffers only (non-persistent): no state-dict keys
        self.config = config
        kinds = getattr(config, "layer_types", None)
        if kinds is not None:
            self.sliding = kinds[index] == "sliding_attention"
        else:  # Mistral: one window for every layer, or none
            self.sliding = getattr(config, "sliding_window", None) is not None
        #: how many sequence-parallel shards the hidden states arrive in (``tensor_parallel``):
        #: positions and the mask are those of the whole sequence
        self.sequence_shards = 1

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``token_mask``: which tokens per-token statistics count (padding 0), read by the
        router losses of mixture-of-experts layers (``router_losses``); a dense layer has none
        and takes it only so that every family's layers accept packed rows' side inputs."""
        if position_ids is not None and self.family is not None and not self.family.packing:
            raise ValueError(
                f"{self.family.model_type}: transformers' model builds its mask without the "
                "position ids, so packed documents would attend to each other; give padded rows "
                "(attention_mask, no position_ids; --packing none)"
            )
        whole = hidden
        if self.sequence_shards > 1:  # a view of the whole sequence's shape, no copy
            rows, tokens, width = hidden.shape
            whole = hidden[:, :1].expand(rows, tokens * self.sequence_shards, width)
        positions = masks.positions(whole, position_ids)
        shape = (tuple(whole.shape), hidden.dtype, hidden.device)
        mask = self.shared.get(
            ("mask", id(self.config), self.sliding, *shape),
            (attention_mask, position_ids),
            lambda: masks.layer_mask(
                self.config, whole, attention_mask, position_ids, self.sliding
            ),
        )
        rotary = self.shared.get(
            ("rotary", id(self.rotary_emb), *shape),
            (position_ids, getattr(self.rotary_emb, "inv_freq", None)),
            lambda: self.rotary_emb(hidden, position_ids=positions),
        )
        return self.wrapped(
            hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary
        )


class GPT2Embedding(nn.Module):
    """GPT-2's token and position embeddings and their dropout (named as in the model:
    ``transformer.wte``, ``transformer.wpe``)."""

    def __init__(self, body: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = body.wte, body.wpe, body.drop

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        positions = masks.positions(input_ids, position_ids)
        return self.drop(self.wte(input_ids) + self.wpe(positions))


class GPT2Layer(_Adopting):
    """A GPT-2 block that builds its own causal mask (or takes it from the block before it in the
    same micro-batch: ``shared``)."""

    #: the layer's row of ``pipetrain.hf.families`` (set by the family's builder)
    family: Any = None

    def __init__(self, block: nn.Module, config, shared: masks.BuiltOnce | None = None) -> None:
        super().__init__(block)
        self.config = config
        self.shared = shared if shared is not None else masks.BuiltOnce()

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``token_mask``: taken and unused, as by ``DecoderLayer`` (no router here)."""
        positions = masks.positions(hidden, position_ids)
        mask = self.shared.get(
            ("mask", id(self.config), tuple(hidden.shape), hidden.dtype, hidden.device),
            (attention_mask, position_ids),
            lambda: masks.layer_mask(self.config, hidden, attention_mask, position_ids, False),
        )
        return self.wrapped(hidden, None, mask, position_ids=positions)
