"""A mixture-of-experts decoder layer that adds its router's balancing loss, per layer and per
micro-batch, to the pipeline's loss.

``transformers`` computes the load-balancing loss once per ``forward``: every layer's router
logits concatenated, over the whole batch (``load_balancing_loss_func``: Switch Transformer's
``num_experts · Σ_e f_e · P_e``, Fedus et al. 2021, eqs. 4-6, with ``f_e`` the share of top-k
assignments to expert ``e`` and ``P_e`` its mean router probability). That couples every stage
and every micro-batch, which a pipeline cannot reproduce. Megatron-Core
(``switch_load_balancing_loss_func`` per layer) and torchtitan (per MoE layer) use the
per-layer, per-micro-batch form instead, and so does this layer: it applies the family's own
``load_balancing_loss_func`` to its one router's logits over the micro-batch it runs on,
counting the tokens the micro-batch's ``(rows, T)`` attention mask and its ``token_mask`` mark
(padding excluded, exactly: the function weighs each token by the mask; packed rows have no
attention mask, so their ``token_mask`` marks the pad tail), multiplies by the config's
``router_aux_loss_coef`` and records it with ``runtime.extra_losses.record_extra_loss`` under
``"router_aux_loss"``. Summed over layers and averaged over micro-batches by the runtime, that is
the loss of the unsplit model run layer by layer under gradient accumulation.

The term is added where ``transformers`` adds one: when the config asks for router logits
(``output_router_logits``, which its ``CausalLM.forward`` reads) and its coefficient is not 0.
The router's logits are taken from the router module's own output (a forward hook, armed only
while this layer runs), so they are the very tensor the experts were routed by.

Each call also picks the kernel its experts run on, by ``experts_kernel``'s fixed rule for the
hidden states' device and dtype (or the layer's ``experts_choice``), in a setting of the
layer's own.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from pipetrain.hf import masks
from pipetrain.hf.decoder_layers import DecoderLayer
from pipetrain.hf.experts_kernel import (
    ExpertsSetting,
    check_choice,
    experts_implementation,
    experts_modules,
    own_setting,
)
from pipetrain.runtime.extra_losses import record_extra_loss

#: the name the balancing term is recorded under
ROUTER_AUX_LOSS = "router_aux_loss"


class _RouterLogits:
    """A forward hook that keeps the router's logits (its output's first element) while armed."""

    def __init__(self) -> None:
        self.armed = False
        self.logits: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.armed:
            self.logits = output[0] if isinstance(output, tuple) else output


def router_loss_wanted(config: Any) -> bool:
    """Whether ``transformers`` adds the router loss for this config: router logits asked for
    and a coefficient other than 0."""
    return bool(getattr(config, "output_router_logits", False)) and bool(
        getattr(config, "router_aux_loss_coef", 0.0)
    )


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer of a mixture-of-experts family (``DecoderLayer``'s masks and rotary
    table), recording its router's balancing loss for the micro-batch it runs on (see the module
    docstring). A layer without a router (Qwen-MoE's dense ``mlp_only_layers``) records nothing.

    ``router``: the router module's path in the layer (``"mlp.gate"``); ``balancing``: the
    ``transformers`` module whose ``load_balancing_loss_func`` is the family's; ``num_experts``:
    the config field that counts the experts; ``experts``: which kernel its experts run on,
    ``"auto"`` (a fixed rule on the hidden states' device and dtype), ``"grouped"`` or
    ``"loop"`` (``experts_kernel``), settable afterwards as ``experts_choice``."""

    def __init__(
        self,
        layer: nn.Module,
        rotary_emb: nn.Module,
        config: Any,
        index: int,
        shared: masks.BuiltOnce | None = None,
        *,
        router: str,
        balancing: str,
        num_experts: str,
        experts: str = "auto",
    ) -> None:
        super().__init__(layer, rotary_emb, config, index, shared)
        #: ``"auto"``, ``"grouped"`` or ``"loop"``: the experts' kernel (``experts_kernel``)
        self.experts_choice = check_choice(experts)
        #: this layer's own experts setting (the model's config stays as it was)
        self._settings: list[ExpertsSetting] = [own_setting(m) for m in experts_modules(layer)]
        try:
            found: nn.Module | None = layer.get_submodule(router)
        except AttributeError:
            found = None
        self.num_experts = int(getattr(config, num_experts))
        self.top_k = int(config.num_experts_per_tok)
        self.coefficient = float(getattr(config, "router_aux_loss_coef", 0.0))
        self._balancing = importlib.import_module(balancing).load_balancing_loss_func
        self._capture: _RouterLogits | None = None
        if found is not None and router_loss_wanted(config):
            self._capture = _RouterLogits()
            found.register_forward_hook(self._capture)

    @property
    def has_router(self) -> bool:
        """Whether this layer routes tokens to experts and records a router loss."""
        return self._capture is not None

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._settings:
            chosen = experts_implementation(self.experts_choice, hidden.device, hidden.dtype)
            for setting in self._settings:
                setting._experts_implementation = chosen
        capture = self._capture
        if capture is None:
            return super().forward(hidden, attention_mask, position_ids)
        counted = counted_tokens(hidden, attention_mask, token_mask)
        capture.armed, capture.logits = True, None
        try:
            out = super().forward(hidden, attention_mask, position_ids)
            logits = capture.logits
        finally:
            capture.armed, capture.logits = False, None
        if logits is None:
            raise ValueError(f"{type(self.wrapped).__name__}'s router did not run")
        balance = self._balancing((logits,), self.num_experts, self.top_k, counted)
        record_extra_loss(self, ROUTER_AUX_LOSS, self.coefficient * balance)
        return out


def counted_tokens(
    hidden: torch.Tensor, attention_mask: torch.Tensor | None, token_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """The ``(rows, T)`` 0/1 weights of the tokens the router loss counts (``None``: all):
    those both masks mark, where given. Packed rows say which tokens are padding only through
    ``token_mask`` (their ``attention_mask`` is absent: the documents come from the position
    ids); padded rows through their 2-D ``attention_mask``. A prepared 4-D mask says nothing
    about padding, so it needs a ``token_mask`` beside it."""
    rows_tokens = tuple(hidden.shape[:2])
    if token_mask is not None and tuple(token_mask.shape) != rows_tokens:
        raise ValueError(
            f"token_mask has shape {tuple(token_mask.shape)} but the rows and tokens are "
            f"{rows_tokens}; give one 0/1 entry per token (1: counted, 0: padding)"
        )
    if attention_mask is None or attention_mask.dim() != 2:
        if attention_mask is not None and token_mask is None:
            raise ValueError(
                f"the router loss counts the tokens of a (rows, T) attention_mask or a "
                f"token_mask; got an attention_mask of shape {tuple(attention_mask.shape)}, "
                "which does not say which tokens are padding: pass the 2-D 0/1 mask, or a "
                "token_mask beside it"
            )
        return token_mask
    if token_mask is None:
        return attention_mask
    return attention_mask * token_mask
