"""Hugging Face causal language models, cut into pipeline stages.

From a released model folder (each rank reads only its own layers' tensors)::

    stages = pipetrain.hf.from_pretrained("Llama-3.2-1B", [9, 9])   # layers per stage
    pipe = Pipeline(stages, "1f1b", 8, pipetrain.hf.causal_lm_loss)
    pipe.step(input_ids, input_ids)                     # labels are the inputs, shifted inside
    pipetrain.hf.save_pretrained(pipe, "out")           # every rank: a folder transformers loads

From a model in memory::

    layers = pipetrain.hf.causal_lm_layers(model)      # {"model.embed_tokens": ..., ...}
    stages = pipetrain.split(layers, [2, 2])            # names kept: HF state-dict keys

Padded or packed batches: ``side={"attention_mask": ..., "position_ids": ...}`` with
``targets=next_token_targets(labels, ...)`` and ``causal_lm_token_loss`` (``masks``).

Supported (model types checked, anything else refused): ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``GPT2LMHeadModel`` and the mixture-of-experts
``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM`` and ``GptOssForCausalLM``
(bf16 folders; each MoE layer adds its router's balancing loss per micro-batch:
``router_losses``), and ``DeepseekV3ForCausalLM`` (balanced by its per-expert bias, moved after
each optimizer step: ``expert_bias``; folders holding its multi-token-prediction weights are
refused: ``deepseek``). Training only (no KV cache). ``transformers`` and ``safetensors`` are
imported only by this package, when used (``pip install pipetrain[hf]``).

Modules: ``families`` (one row per model family: builder, wrapper, tensor-parallel plan or
refusal, experts, ties, buffers), ``causal_lm`` (layers, losses, ties), ``decoder_layers`` (the
wrappers), ``router_losses`` (MoE layers' balancing loss), ``deepseek`` (DeepSeek-V3's layers),
``expert_bias`` (auxiliary-loss-free balancing: ``update_expert_biases``), ``masks`` (side inputs and targets),
``pretrained`` (``from_pretrained``), ``checkpoint_files`` (reading and writing the folder's
safetensors files), ``export`` (``save_pretrained``), ``tensor_parallel`` (the Llama family's tensor-parallel
plan, ``parallelize_causal_lm``).
"""

from pipetrain.hf.causal_lm import (
    IGNORE_INDEX,
    CausalLMTokenLoss,
    causal_lm_layers,
    causal_lm_loss,
    causal_lm_token_loss,
    tied_weights,
)
from pipetrain.hf.decoder_layers import DecoderLayer, GPT2Embedding, GPT2Layer
from pipetrain.hf.expert_bias import update_expert_biases
from pipetrain.hf.export import save_pretrained
from pipetrain.hf.families import FAMILIES, LLAMA_FAMILY, REFUSED, SUPPORTED, Family, family_of
from pipetrain.hf.masks import next_token_targets, packed_position_ids
from pipetrain.hf.pretrained import PretrainedStages, from_pretrained
from pipetrain.hf.router_losses import ROUTER_AUX_LOSS, MoeDecoderLayer
from pipetrain.hf.tensor_parallel import parallelize_causal_lm

__all__ = [
    "FAMILIES",
    "IGNORE_INDEX",
    "LLAMA_FAMILY",
    "REFUSED",
    "ROUTER_AUX_LOSS",
    "SUPPORTED",
    "CausalLMTokenLoss",
    "DecoderLayer",
    "Family",
    "GPT2Embedding",
    "GPT2Layer",
    "MoeDecoderLayer",
    "PretrainedStages",
    "causal_lm_layers",
    "causal_lm_loss",
    "causal_lm_token_loss",
    "family_of",
    "from_pretrained",
    "next_token_targets",
    "packed_position_ids",
    "parallelize_causal_lm",
    "save_pretrained",
    "tied_weights",
    "update_expert_biases",
]
