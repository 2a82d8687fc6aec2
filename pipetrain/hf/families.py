"""The Hugging Face model families ``pipetrain.hf`` cuts into layers, as rows of one table.

A row says everything the package does differently per family: how the model becomes a layer
list (the builder and the decoder wrapper), its tensor-parallel plan or why there is none, its
expert-parallel plan (``runtime.parallel.expert_parallel.shard_experts`` on the modules named
by ``experts``), the parameters the
family ties and the non-persistent buffers its ``_init_weights`` recomputes (in no checkpoint).
``causal_lm`` (layers), ``pretrained`` (loading), ``export`` (ties) and ``tensor_parallel`` look
their family up here rather than testing model types, so a new family is one row (and, where
its layers differ, one wrapper). Families ``transformers`` has but pipetrain cannot yet run
exactly are rows of ``REFUSED``, each with the reason a user sees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from pipetrain.hf import masks
from pipetrain.hf.decoder_layers import DecoderLayer, GPT2Embedding, GPT2Layer
from pipetrain.hf.deepseek import (
    DeepseekV3Layer,
    deepseek_v3_layers,
    refuse_multi_token_prediction,
)
from pipetrain.hf.router_losses import MoeDecoderLayer
from pipetrain.hf.stored_layout import FolderTensors, StoredExperts
from pipetrain.hf.tensor_parallel import decoder_plan
from pipetrain.runtime.parallel.expert_parallel import shard_experts

#: the tie ``transformers`` makes for ``tie_word_embeddings`` in the Llama-style families
LLAMA_TIE = (("model.embed_tokens.weight", "lm_head.weight"),)
#: RoPE's tables: non-persistent, recomputed by the model's ``_init_weights``
ROPE_BUFFERS = ("inv_freq", "original_inv_freq")
MOE_NO_TP = (
    "--tp with MoE needs expert tensor parallel, which pipetrain does not have yet (the experts' "
    "3-D weights would stay whole on every tensor-parallel rank); use --tp 1"
)


@dataclass(frozen=True)
class Family:
    """One model family: what ``pipetrain.hf`` needs to know to cut, load, save and parallelize
    its causal LM."""

    model_type: str
    #: ``(family, model, shared) -> {name: layer}`` in call order (``causal_lm_layers``)
    builder: Callable[[Family, Any, masks.BuiltOnce], dict[str, nn.Module]]
    #: the wrapper of its decoder layers (what ``recompute`` may wrap)
    decoder: type[nn.Module]
    #: ``(sequence_parallel) -> plan`` of one decoder layer, or ``None`` (see the refusal)
    tensor_parallel: Callable[[bool], dict[str, Any]] | None = decoder_plan
    tensor_parallel_refusal: str = ""
    #: ``(layer, ep_mesh, experts) -> sharded count``: shards a decoder layer's ``experts``
    #: modules over the ``("edp", "ep")`` mesh (``apply_expert_parallel``); None: no experts
    expert_parallel: Callable[[nn.Module, Any, tuple[str, ...]], int] | None = None
    #: the expert modules in a decoder layer (MoE families)
    experts: tuple[str, ...] = ()
    #: the router module in a decoder layer, whose first output is its logits (MoE families)
    router: str = ""
    #: the ``transformers`` module whose ``load_balancing_loss_func`` is the family's
    balancing: str = ""
    #: the config field counting the routed experts
    num_experts: str = ""
    #: how its folders store the experts the model holds fused (MoE families)
    stored: StoredExperts | None = None
    #: (source, target) parameter names tied under ``tie_word_embeddings``
    tied: tuple[tuple[str, str], ...] = LLAMA_TIE
    #: non-persistent buffers in no checkpoint, recomputed by the model's ``_init_weights``
    buffers: tuple[str, ...] = ROPE_BUFFERS
    #: whether its ``forward`` keeps packed documents apart (builds its mask from the position
    #: ids); where not, given position ids are refused rather than masked differently
    packing: bool = True
    #: ``(files, config) -> None``: refuses a folder whose tensors the family cannot train
    #: (``checkpoint_files.ModelFiles``; DeepSeek-V3's multi-token-prediction weights)
    folder_check: Callable[[Any, Any], None] | None = None
    #: whether its routers carry a per-expert bias that ``expert_bias`` moves after each
    #: optimizer step (auxiliary-loss-free balancing)
    expert_bias: bool = False

    @property
    def is_moe(self) -> bool:
        return bool(self.experts)

    def layers(self, model: Any) -> dict[str, nn.Module]:
        """``model`` as its layers in call order, each wrapper carrying this row as ``family``."""
        built = self.builder(self, model, masks.BuiltOnce())
        for layer in built.values():
            if isinstance(layer, (DecoderLayer, GPT2Layer)):
                layer.family = self
        return built

    def folder_tensors(self, files: Any, config: Any, prefix: str) -> FolderTensors:
        """A folder's tensors (``checkpoint_files.ModelFiles``) as a model of ``config`` names
        them, experts fused from the family's stored layout (a ``ValueError`` where the
        family's ``folder_check`` refuses the folder)."""
        if self.folder_check is not None:
            self.folder_check(files, config)
        experts = int(getattr(config, self.num_experts)) if self.stored is not None else 0
        return FolderTensors(files, self.stored, experts, prefix)

    def file_state(self, state: dict[str, Any], config: Any) -> dict[str, Any]:
        """A state dict under the names and in the layout the family's folders use (each
        fused expert parameter split per expert), as ``transformers``' ``save_pretrained``
        writes it."""
        if self.stored is None:
            return state
        return self.stored.unfuse(state, int(getattr(config, self.num_experts)))

    def tied_pairs(self, config: Any) -> list[tuple[str, str]]:
        """The (source, target) names a model of ``config`` ties: the family's pairs where the
        config ties word embeddings (``transformers``' rule), else none."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return list(self.tied) if getattr(text, "tie_word_embeddings", False) else []


def _llama_style(family: Family, model: Any, shared: masks.BuiltOnce) -> dict[str, nn.Module]:
    """Embedding, decoder layers, final norm, head (``model.model``'s layout)."""
    config, body = model.config, model.model
    layers: dict[str, nn.Module] = {"model.embed_tokens": body.embed_tokens}
    for i, layer in enumerate(body.layers[: config.num_hidden_layers]):
        if family.decoder is MoeDecoderLayer:
            layers[f"model.layers.{i}"] = MoeDecoderLayer(
                layer,
                body.rotary_emb,
                config,
                i,
                shared,
                router=family.router,
                balancing=family.balancing,
                num_experts=family.num_experts,
            )
        else:
            layers[f"model.layers.{i}"] = DecoderLayer(layer, body.rotary_emb, config, i, shared)
    layers["model.norm"] = body.norm
    layers["lm_head"] = model.lm_head
    return layers


def _gpt2(family: Family, model: Any, shared: masks.BuiltOnce) -> dict[str, nn.Module]:
    """GPT-2's embeddings as one layer, its blocks, final norm and head."""
    body = model.transformer
    layers: dict[str, nn.Module] = {"transformer": GPT2Embedding(body)}
    for i, block in enumerate(body.h):
        layers[f"transformer.h.{i}"] = GPT2Layer(block, model.config, shared)
    layers["transformer.ln_f"] = body.ln_f
    layers["lm_head"] = model.lm_head
    return layers


def _dense(model_type: str) -> Family:
    return Family(model_type, _llama_style, DecoderLayer)


def _moe(
    model_type: str,
    num_experts: str,
    stored: StoredExperts | None,
    router: str = "mlp.gate",
    packing: bool = True,
) -> Family:
    return Family(
        model_type,
        _llama_style,
        MoeDecoderLayer,
        tensor_parallel=None,
        tensor_parallel_refusal=MOE_NO_TP,
        expert_parallel=shard_experts,
        experts=("mlp.experts",),
        router=router,
        balancing=f"transformers.models.{model_type}.modeling_{model_type}",
        num_experts=num_experts,
        stored=stored,
        packing=packing,
    )


#: every family ``pipetrain.hf`` runs, by ``config.model_type``
FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        _dense("llama"),
        _dense("qwen2"),
        _dense("qwen3"),
        _dense("mistral"),
        Family(
            "gpt2",
            _gpt2,
            GPT2Layer,
            tensor_parallel=None,
            tensor_parallel_refusal=(
                "tensor parallel supports the Llama family; GPT-2's projections are Conv1D, "
                "not nn.Linear"
            ),
            tied=(("transformer.wte.weight", "lm_head.weight"),),
            buffers=(),
        ),
        _moe("qwen2_moe", "num_experts", StoredExperts()),
        _moe("qwen3_moe", "num_experts", StoredExperts()),
        _moe("mixtral", "num_local_experts", StoredExperts("block_sparse_moe", "w1", "w3", "w2")),
        # bf16 folders store the experts fused, under the model's names; its forward builds
        # the mask without the position ids, so packed documents would see each other
        _moe("gpt_oss", "num_local_experts", None, router="mlp.router", packing=False),
        # dense first layers, shared experts, multi-latent attention; balanced by a per-expert
        # bias moved after each optimizer step (expert_bias), not by a loss: no balancing
        # function (transformers has none for it)
        Family(
            "deepseek_v3",
            deepseek_v3_layers,
            DeepseekV3Layer,
            tensor_parallel=None,
            tensor_parallel_refusal=MOE_NO_TP,
            expert_parallel=shard_experts,
            experts=("mlp.experts",),
            router="mlp.gate",
            num_experts="n_routed_experts",
            stored=StoredExperts(),
            folder_check=refuse_multi_token_prediction,
            expert_bias=True,
        ),
    )
}

#: families ``transformers`` has that pipetrain refuses, with the reason
REFUSED: dict[str, str] = {}

#: the model types whose forward is embedding → decoder layers → norm → head and which have the
#: Llama family's tensor-parallel plan
LLAMA_FAMILY = tuple(t for t, f in FAMILIES.items() if f.tensor_parallel is decoder_plan)
#: every model type ``pipetrain.hf`` cuts into layers
SUPPORTED = tuple(FAMILIES)


def family_of(model_or_config: Any) -> Family:
    """The row of a model or config (its ``model_type``); a one-line ``ValueError`` gives the
    reason for a refused family and lists the supported ones for any other."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    if model_type in REFUSED:
        raise ValueError(f"{model_type}: not supported yet: {REFUSED[model_type]}")
    dense = [t for t, f in FAMILIES.items() if not f.is_moe]
    moe = [t for t, f in FAMILIES.items() if f.is_moe]
    raise ValueError(
        f"pipetrain.hf supports causal LMs of model types {', '.join(dense)}; got "
        f"{type(model_or_config).__name__} (model_type={model_type!r}); it also supports the "
        f"mixture-of-experts model types {', '.join(moe)}"
    )
