"""Hugging Face causal LMs as an ordered list of layers under their model names.

A ``transformers`` model runs its layers inside one ``forward`` that computes, once, what every
layer needs: position ids, the rotary table (Llama family), the attention mask. Cut into stages
those would have to be threaded through every stage's outputs. Here each decoder layer is
wrapped so it makes its own from the hidden states it receives and the side inputs it is given
(``attention_mask``, ``position_ids``; ``pipetrain.hf.masks``) — position ids ``0..T-1`` unless
given, the rotary table from the model's own ``rotary_emb`` module and the mask from
``transformers``' own mask functions (the sliding-window one where the config gives that layer a
window) — exactly what the unsplit ``forward`` computes from the same inputs, recomputed per
layer (a small cost next to attention).

Every layer keeps its model name, and a wrapper registers the wrapped layer's children as its
own, so parameter names are the model's (``model.layers.3.self_attn.q_proj.weight``) and a
``transformers`` checkpoint loads by name whatever the cut. The modules are the model's own (no
copies): the model and its layers share parameters, and nothing of the model is changed.

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

from pipetrain.hf import masks
from pipetrain.hf.masks import IGNORE_INDEX

#: model types whose forward is exactly embedding → decoder layers → norm → head
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED = (*LLAMA_FAMILY, "gpt2")


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
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(
            f"pipetrain.hf supports causal LMs of model types {', '.join(SUPPORTED)}; got "
            f"{type(model).__name__} (model_type={model_type!r})"
        )
    config = model.config
    if getattr(config, "add_cross_attention", False):
        raise ValueError("cross-attention (add_cross_attention=True) is not supported")
    shared = masks.BuiltOnce()  # the layers' masks and rotary tables, built once per micro-batch
    if model_type == "gpt2":
        body = model.transformer
        layers: dict[str, nn.Module] = {"transformer": GPT2Embedding(body)}
        for i, block in enumerate(body.h):
            layers[f"transformer.h.{i}"] = GPT2Layer(block, config, shared)
        layers["transformer.ln_f"] = body.ln_f
    else:
        body = model.model
        layers = {"model.embed_tokens": body.embed_tokens}
        for i, layer in enumerate(body.layers[: config.num_hidden_layers]):
            layers[f"model.layers.{i}"] = DecoderLayer(layer, body.rotary_emb, config, i, shared)
        layers["model.norm"] = body.norm
    layers["lm_head"] = model.lm_head
    return layers


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
    ) -> torch.Tensor:
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

    def __init__(self, block: nn.Module, config, shared: masks.BuiltOnce | None = None) -> None:
        super().__init__(block)
        self.config = config
        self.shared = shared if shared is not None else masks.BuiltOnce()

    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        positions = masks.positions(hidden, position_ids)
        mask = self.shared.get(
            ("mask", id(self.config), tuple(hidden.shape), hidden.dtype, hidden.device),
            (attention_mask, position_ids),
            lambda: masks.layer_mask(self.config, hidden, attention_mask, position_ids, False),
        )
        return self.wrapped(hidden, None, mask, position_ids=positions)
