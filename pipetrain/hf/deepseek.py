"""DeepSeek-V3 (``DeepseekV3ForCausalLM``) as a layer list: its decoder wrapper, its builder, and
the refusal of folders holding its multi-token-prediction module.

The model is Llama-shaped from the outside (embedding, decoder layers, final norm, head; one
rotary table; one causal mask), so its layers are cut like the Llama family's. Inside, the first
``first_k_dense_replace`` layers have a dense MLP and the rest a mixture of experts with shared
experts and a sigmoid router that picks the top-k experts within the best ``topk_group`` of
``n_group`` groups, after adding the per-expert bias ``e_score_correction_bias`` to the
affinities (DeepSeek-V3 report, arXiv 2412.19437, §2.1.2); attention is multi-latent (§2.1.1),
all inside the ``transformers`` layer, which runs as it is. What differs from the other MoE
families is the balancing: no loss term (``transformers`` computes none for DeepSeek-V3, and its
config has no coefficient), but the bias, moved after each optimizer step from the loads each
router counts (``expert_bias``). ``DeepseekV3Layer`` arms that count while its layer runs.

Multi-token prediction (§2.2): released folders store ``num_nextn_predict_layers`` extra modules
as ``model.layers.{num_hidden_layers + d}.*``; ``transformers`` builds no module for them and
drops them on load. ``pipetrain.hf`` does not train them yet and does not drop them silently
either: a folder that holds them is refused (``refuse_multi_token_prediction``), and the opt-out
is explicit — the folder's ``config.json`` saying ``num_nextn_predict_layers: 0`` declares a
model without the module, which then trains (and exports) without those tensors.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from pipetrain.hf import masks
from pipetrain.hf.decoder_layers import DecoderLayer
from pipetrain.hf.expert_bias import BIAS, ExpertLoad

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class DeepseekV3Layer(DecoderLayer):
    """A DeepSeek-V3 decoder layer (``DecoderLayer``'s masks and rotary table) that counts its
    router's choices for the bias update (``expert_bias``); a dense layer counts nothing."""

    def __init__(
        self,
        layer: nn.Module,
        rotary_emb: nn.Module,
        config: Any,
        index: int,
        shared: masks.BuiltOnce | None = None,
    ) -> None:
        super().__init__(layer, rotary_emb, config, index, shared)
        router = getattr(getattr(layer, "mlp", None), "gate", None)
        #: the router's load counter (``None`` in a dense layer)
        self.expert_load: ExpertLoad | None = None
        if isinstance(router, nn.Module) and isinstance(getattr(router, BIAS, None), torch.Tensor):
            self.expert_load = ExpertLoad(router, f"model.layers.{index}")

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        token_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``token_mask``: which tokens count (a packed row's pad tail 0), with a 2-D
        ``attention_mask`` where both are given."""
        if self.expert_load is None:
            return super().forward(hidden, attention_mask, position_ids, token_mask)
        counted = attention_mask
        if token_mask is not None:
            if attention_mask is not None and attention_mask.dim() == 2:
                counted = token_mask * attention_mask
            else:
                counted = token_mask
        with self.expert_load.counting(counted):
            return super().forward(hidden, attention_mask, position_ids, token_mask)


def deepseek_v3_layers(family: Any, model: Any, shared: masks.BuiltOnce) -> dict[str, nn.Module]:
    """Embedding, decoder layers (dense then MoE, each a ``DeepseekV3Layer``), final norm,
    head."""
    config, body = model.config, model.model
    layers: dict[str, nn.Module] = {"model.embed_tokens": body.embed_tokens}
    for i, layer in enumerate(body.layers[: config.num_hidden_layers]):
        layers[f"model.layers.{i}"] = DeepseekV3Layer(layer, body.rotary_emb, config, i, shared)
    layers["model.norm"] = body.norm
    layers["lm_head"] = model.lm_head
    return layers


def multi_token_prediction_tensors(names: Any, config: Any) -> list[str]:
    """The stored tensors of multi-token-prediction modules: layer indices from
    ``num_hidden_layers`` on."""
    count = int(config.num_hidden_layers)
    return sorted(n for n in names if (m := _LAYER.search(n)) and int(m[1]) >= count)


def refuse_multi_token_prediction(files: Any, config: Any) -> None:
    """A one-line ``ValueError`` for a folder (``checkpoint_files.ModelFiles``) holding
    multi-token-prediction weights while its config counts such modules (module docstring)."""
    depth = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    found = multi_token_prediction_tensors(files.where, config)
    if found and depth > 0:
        first = found[0].split(".layers.")[-1].split(".")[0]
        raise ValueError(
            f"{files.folder} holds DeepSeek-V3 multi-token-prediction weights "
            f"({len(found)} tensors under model.layers.{first}.*, num_nextn_predict_layers "
            f"{depth}), which pipetrain.hf cannot train yet (transformers drops them) and will "
            "not drop silently; to train and export without them, set "
            '"num_nextn_predict_layers": 0 in its config.json'
        )
