"""The models ``pipetrain train`` and ``pipetrain profile`` build, each as an ordered list of
layers (``pipetrain.split`` cuts it, the profiler measures it, a plan's ``stage_layers`` count it).

* ``gpt``: the built-in GPT (``app.models.gpt``) as ``[embed, block0, ..., head]``; each layer is
  a ``GPTStage`` seeded by its layer index, so the weights do not depend on the cut, and a rank
  builds only its own layers (``split``'s factory form).
* ``llama``, ``qwen3``, ``mistral``: a Hugging Face causal LM built from a ``transformers`` config
  (random weights, nothing downloaded) as ``pipetrain.hf.causal_lm_layers``: ``[embed_tokens,
  layers.0, ..., norm, lm_head]``. With ``tie_embeddings`` the config ties ``lm_head`` to the
  embedding, and the tie is passed on to the pipeline by name (``pipetrain.hf.tied_weights``).

Tokens are bytes (vocabulary 256), so both kinds train on any text file without a tokenizer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetrain.planner.layout import default_cut

if TYPE_CHECKING:
    import torch
    from torch import nn

MODELS = ("gpt", "llama", "qwen3", "mistral")
HF_MODELS = MODELS[1:]
#: the model types ``--model-dir`` loads: every row of ``pipetrain.hf.families.FAMILIES``, dense
#: and mixture-of-experts (named here, where torch is not imported, for the layer counts below;
#: tests/app/test_moe_train.py checks the two agree)
FOLDER_MODELS = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "gpt2",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
)
BYTE_VOCAB = 256
#: layers besides the blocks: GPT's embedding and head; HF's embedding, final norm and head
EXTRA_LAYERS = {"gpt": (1, 1), **dict.fromkeys((*HF_MODELS, *FOLDER_MODELS), (1, 2))}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What defines a model's weights (a checkpoint must be resumed with the same shape)."""

    model: str
    blocks: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    dtype: str
    seed: int
    tie_embeddings: bool = False

    @property
    def num_layers(self) -> int:
        """Layers of the list: the blocks and the embedding, norm and head around them."""
        first, last = EXTRA_LAYERS[self.model]
        return first + self.blocks + last

    def check(self) -> None:
        """``ValueError`` for a shape no model of this kind can take."""
        if self.model not in MODELS:
            raise ValueError(f"--model {self.model!r}: use one of {', '.join(MODELS)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be a multiple of --heads {self.heads}")
        if self.model == "gpt":
            if self.tie_embeddings:
                raise ValueError(
                    "--tie-embeddings applies to the Hugging Face models "
                    f"({', '.join(HF_MODELS)}); the built-in gpt has a separate head"
                )
        elif self.heads % self.kv_heads:
            raise ValueError(
                f"--heads {self.heads} must be a multiple of --kv-heads {self.kv_heads}"
            )


@dataclass
class LayerModel:
    """A model as layers in call order, with its loss and ties, ready for ``pipetrain.split``."""

    shape: ModelShape
    #: name → layer (built), or a factory index → layer (each rank builds only its own)
    layers: Mapping[str, nn.Module] | Callable[[int], nn.Module]
    names: list[str]
    loss_fn: Callable
    #: the loss takes the inputs as labels and shifts them itself (Hugging Face's convention)
    labels_are_inputs: bool
    tied: list[tuple[str, ...]] = field(default_factory=list)

    def layer_list(self) -> list[nn.Module]:
        """Every layer, built (for the profiler)."""
        if isinstance(self.layers, Mapping):
            return list(self.layers.values())
        return [self.layers(i) for i in range(len(self.names))]

    def batch(
        self, inputs: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)`` for ``Pipeline.step`` from a window and its shift by one."""
        return (inputs, inputs) if self.labels_are_inputs else (inputs, targets)


def default_stage_layers(model: str, blocks: int, num_stages: int) -> tuple[int, ...]:
    """Layers per stage of ``model`` with ``blocks`` blocks when no plan says: the planner's
    ``default_cut`` with this model's layers before and after its blocks."""
    first, last = EXTRA_LAYERS[model]
    return default_cut(blocks, num_stages, first=first, last=last)


def build(shape: ModelShape) -> LayerModel:
    shape.check()
    if shape.model == "gpt":
        return _gpt(shape)
    return _hugging_face(shape)


def _gpt(shape: ModelShape) -> LayerModel:
    import torch

    from pipetrain.app.models.gpt import GPTConfig, gpt_layer, gpt_layer_names, lm_loss

    cfg = GPTConfig(
        vocab_size=shape.vocab,
        seq_len=shape.seq_len,
        num_layers=shape.blocks,
        hidden=shape.hidden,
        num_heads=shape.heads,
    )
    dtype = getattr(torch, shape.dtype)

    def layer(i: int) -> nn.Module:
        return gpt_layer(cfg, i, shape.seed).to(dtype)

    return LayerModel(shape, layer, gpt_layer_names(cfg), lm_loss, labels_are_inputs=False)


def _hugging_face(shape: ModelShape) -> LayerModel:
    import torch

    try:
        import transformers as tf
    except ImportError as e:
        raise ValueError(
            f"--model {shape.model} needs transformers ({e}): pip install 'pipetrain[hf]'"
        ) from None

    from pipetrain.hf import causal_lm_layers, causal_lm_loss, tied_weights

    common: dict[str, Any] = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=4 * shape.hidden,
        num_hidden_layers=shape.blocks,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.seq_len,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=shape.tie_embeddings,
    )
    config: Any
    cls: Any
    if shape.model == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif shape.model == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=shape.hidden // shape.heads)
        cls = tf.Qwen3ForCausalLM
    else:
        config, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    torch.manual_seed(shape.seed)
    model = cls(config).to(getattr(torch, shape.dtype))
    layers = causal_lm_layers(model)
    return LayerModel(
        shape,
        layers,
        list(layers),
        causal_lm_loss,
        labels_are_inputs=True,
        tied=[tuple(pair) for pair in tied_weights(model)],
    )
