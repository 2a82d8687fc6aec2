"""Hugging Face causal LMs as an ordered list of layers under their model names, and their losses.

A ``transformers`` model runs its layers inside one ``forward`` that computes, once, what every
layer needs: position ids, the rotary table (Llama family), the attention mask. Cut into stages
those would have to be threaded through every stage's outputs. Here each decoder layer is
wrapped (``decoder_layers``) so it makes its own from the hidden states it receives and the side
inputs it is given (``attention_mask``, ``position_ids``; ``pipetrain.hf.masks``) — position ids
``0..T-1`` unless given, the rotary table from the model's own ``rotary_emb`` module and the mask
from ``transformers``' own mask functions (the sliding-window one where the config gives that
layer a window) — exactly what the unsplit ``forward`` computes from the same inputs. Which
wrapper and which layout a model gets is its family's row (``families``); a mixture-of-experts
layer also records its router's balancing loss (``router_losses``).

Every layer keeps its model name, and a wrapper registers the wrapped layer's children as its
own, so parameter names are the model's (``model.layers.3.self_attn.q_proj.weight``) and a
``transformers`` checkpoint loads by name whatever the cut. The modules are the model's own (no
copies): the model and its layers share parameters, and nothing of the model is changed (an MoE
router gets a forward hook that does nothing unless its wrapper is running).

A model on the meta device is refused: its non-persistent buffers (RoPE's ``inv_freq``) are in
no state dict, so ``to_empty`` and ``load_state_dict`` would leave them uninitialised, silently.
``pipetrain.hf.from_pretrained`` builds a rank's layers that way and recomputes them.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pipetrain.hf.decoder_layers import DecoderLayer, GPT2Embedding, GPT2Layer
from pipetrain.hf.families import LLAMA_FAMILY, SUPPORTED, family_of
from pipetrain.hf.masks import IGNORE_INDEX

#: the oldest ``transformers`` the wrappers are written against (the ``hf`` extra's floor)
MIN_TRANSFORMERS = (5, 24)


def transformers_problem() -> str | None:
    """Why this environment's ``transformers`` cannot serve ``pipetrain.hf`` (missing, or older
    than ``MIN_TRANSFORMERS``: its layers' signatures and helpers differ), or ``None``."""
    from importlib import metadata

    floor = ".".join(map(str, MIN_TRANSFORMERS))
    try:
        found = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return f"pipetrain.hf needs transformers >= {floor}: pip install 'pipetrain[hf]'"
    match = re.match(r"(\d+)\.(\d+)", found)
    if match is None or (int(match[1]), int(match[2])) < MIN_TRANSFORMERS:
        return (
            f"pipetrain.hf needs transformers >= {floor}; this environment has {found}: "
            f"pip install -U 'transformers>={floor}'"
        )
    return None


def require_transformers() -> None:
    """``ImportError`` with ``transformers_problem``'s message, if there is one."""
    problem = transformers_problem()
    if problem is not None:
        raise ImportError(problem)


def causal_lm_layers(model: Any) -> dict[str, nn.Module]:
    """The model's layers in call order, by their names in the model: embedding, decoder layers,
    final norm, LM head. Each consumes the previous one's output (token ids → hidden states →
    logits); the embedding (GPT-2) and the decoder layers also take ``attention_mask`` and
    ``position_ids`` as side inputs. A ``ValueError`` names the supported model types for any
    other model, and refuses a model on the meta device (see the module docstring); an
    ``ImportError`` an environment whose ``transformers`` is older than ``MIN_TRANSFORMERS``."""
    require_transformers()
    if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        raise ValueError(
            "the model is on the meta device: its non-persistent buffers (RoPE's inv_freq) are "
            "in no state dict or checkpoint, so to_empty + load_state_dict would leave them "
            "uninitialised; load a model folder with pipetrain.hf.from_pretrained(model_dir, "
            "stage_layers), which builds each rank's layers and recomputes them"
        )
    return layers_of(model)


def layers_of(model: Any) -> dict[str, nn.Module]:
    """``causal_lm_layers`` without the meta-device check (``from_pretrained`` materialises
    the layers and recomputes their buffers itself)."""
    config = getattr(model, "config", None)
    family = family_of(model)
    if getattr(config, "add_cross_attention", False):
        raise ValueError("cross-attention (add_cross_attention=True) is not supported")
    return family.layers(model)


def tied_weights(model: Any) -> list[tuple[str, str]]:
    """The parameter pairs the model ties (from ``_tied_weights_keys``), by global name — the
    model's names, which ``causal_lm_layers`` keeps — where they are one parameter now (a config
    with ``tie_word_embeddings=False`` ties nothing)."""
    keys = getattr(model, "_tied_weights_keys", None) or {}
    if not isinstance(keys, dict):  # transformers 4: a list of tied names, tied to the input side
        embedding = model.get_input_embeddings()
        source = next(n for n, m in model.named_modules() if m is embedding) + ".weight"
        keys = dict.fromkeys(keys, source)
    pairs = []
    for target, source in keys.items():
        try:
            same = model.get_parameter(target) is model.get_parameter(source)
        except AttributeError:
            continue
        if same:
            pairs.append((source, target))
    return pairs


class CausalLMLoss:
    """Next-token cross entropy: position ``t`` predicts ``labels[:, t + 1]``, mean over every
    predicted token (as ``transformers`` computes it with ``labels=input_ids``; logits below
    float32 are upcast first, as there). ``causal_lm_loss`` is one.

    In a pipeline, labels equal to -100 (``ignore_index``) are refused: the pipeline weighs
    micro-batches by rows, which is the token mean only when every row counts the same number of
    tokens. The pipeline checks a step's labels on the host before the step (``check_targets``),
    so the loss itself never waits for the device: not per micro-batch, and not inside a captured
    step (``cuda_graph=True``), where waiting is not allowed. Called alone, it is
    ``transformers``' loss (tokens labelled -100 left out of the mean)."""

    def check_targets(self, labels: object) -> None:
        if isinstance(labels, (tuple, list)):
            labels = labels[0] if labels else None
        if isinstance(labels, torch.Tensor) and bool((labels == IGNORE_INDEX).any()):
            raise ValueError(
                "labels contain -100 (ignore_index): padded batches need a loss normalised by the "
                "global token count; causal_lm_loss takes whole rows (every token counted). Use "
                "targets=pipetrain.hf.next_token_targets(labels, ...) with "
                "pipetrain.hf.causal_lm_token_loss"
            )

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        predicted = logits[:, :-1]
        if predicted.dtype not in (torch.float32, torch.float64):
            predicted = predicted.float()
        vocab = predicted.shape[-1]
        return F.cross_entropy(predicted.reshape(-1, vocab), labels[:, 1:].reshape(-1))


causal_lm_loss = CausalLMLoss()


class CausalLMTokenLoss:
    """Cross entropy of logits ``(rows, T, vocab)`` against targets ``(rows, T)`` already shifted
    (``pipetrain.hf.next_token_targets``), summed over targets that are not ``ignore_index``;
    the pipeline divides by the whole batch's count (``loss_reduction = "token_mean"``), which is
    ``transformers``' loss for labels with -100. Logits below float32 are upcast first, as
    there."""

    loss_reduction = "token_mean"

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.shape[:-1] != targets.shape:
            raise ValueError(
                f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not align; "
                "pass targets=pipetrain.hf.next_token_targets(labels) (shifted, same length)"
            )
        if logits.dtype not in (torch.float32, torch.float64):
            logits = logits.float()
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=self.ignore_index,
            reduction="sum",
        )


#: the next-token loss for padded or packed batches (``Pipeline`` reads its ``loss_reduction``)
causal_lm_token_loss = CausalLMTokenLoss()


__all__ = [
    "IGNORE_INDEX",
    "LLAMA_FAMILY",
    "MIN_TRANSFORMERS",
    "SUPPORTED",
    "CausalLMLoss",
    "CausalLMTokenLoss",
    "DecoderLayer",
    "GPT2Embedding",
    "GPT2Layer",
    "causal_lm_layers",
    "causal_lm_loss",
    "causal_lm_token_loss",
    "layers_of",
    "require_transformers",
    "tied_weights",
    "transformers_problem",
]
