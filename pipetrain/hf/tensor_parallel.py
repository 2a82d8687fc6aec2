"""Tensor parallel for the Llama family's layers, in torch's own ``parallelize_module`` styles.

Megatron-LM's split of a transformer block (Shoeybi et al., "Megatron-LM", 2019): in attention
the query, key and value projections are split by output features (``ColwiseParallel``: each
rank owns whole heads) and the output projection by input features (``RowwiseParallel``: one
all-reduce per block); in the MLP the gate and up projections colwise, the down projection
rowwise. The embedding is split by vocabulary rows and the head by vocabulary columns, its
logits gathered. With ``sequence_parallel`` (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022) the norms run on a shard of the sequence, the
all-reduces become a reduce-scatter and an all-gather, and the hidden states between layers —
between pipeline stages too — hold 1/tp of the tokens.

``parallelize_causal_lm(module, mesh["tp"])`` applies it to every layer it finds in ``module``
(a stage of ``pipetrain.split``, the layer dict of ``causal_lm_layers`` or the whole model),
before the ``Pipeline`` is built with the same mesh. The attention modules need no change:
``transformers`` infers the local head count from the projections' shapes.

Which layers take the plan is their family's row (``pipetrain.hf.families``). Refused, with
the row's reason: GPT-2 (its ``Conv1D`` projections are not ``nn.Linear``) and the
mixture-of-experts families (their experts need expert tensor parallel); head counts the mesh
does not divide. A tied embedding and head stay whole (replicated) so the tied sum adds whole
gradients.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch import nn

from pipetrain.hf.decoder_layers import DecoderLayer, GPT2Layer

_log = logging.getLogger(__name__)


def _styles() -> Any:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    class Styles:
        colwise, rowwise, sequence = ColwiseParallel, RowwiseParallel, SequenceParallel
        prepare, replicate, shard = PrepareModuleInput, Replicate, Shard

    return Styles


def decoder_plan(sequence_parallel: bool) -> dict[str, Any]:
    """The plan of one decoder layer (names as in ``LlamaDecoderLayer``)."""
    t = _styles()
    plan: dict[str, Any] = {
        "self_attn.q_proj": t.colwise(),
        "self_attn.k_proj": t.colwise(),
        "self_attn.v_proj": t.colwise(),
        "mlp.gate_proj": t.colwise(),
        "mlp.up_proj": t.colwise(),
    }
    if not sequence_parallel:
        return plan | {"self_attn.o_proj": t.rowwise(), "mlp.down_proj": t.rowwise()}
    seq, whole = t.shard(1), t.replicate()
    return plan | {
        "input_layernorm": t.sequence(),
        "self_attn": t.prepare(
            input_kwarg_layouts={"hidden_states": seq},
            desired_input_kwarg_layouts={"hidden_states": whole},
        ),
        "self_attn.o_proj": t.rowwise(output_layouts=seq),
        "post_attention_layernorm": t.sequence(),
        "mlp": t.prepare(input_layouts=(seq,), desired_input_layouts=(whole,)),
        "mlp.down_proj": t.rowwise(output_layouts=seq),
    }


def parallelize_causal_lm(
    module: nn.Module | Mapping[str, nn.Module],
    tp_mesh: Any,
    *,
    sequence_parallel: bool = False,
    vocab_parallel: bool = True,
) -> None:
    """Tensor-parallelize every Llama-family layer in ``module`` on ``tp_mesh`` (in place).

    ``vocab_parallel``: split the embedding and the head over the vocabulary (else replicate
    them). A tied embedding and head need ``vocab_parallel=False``: the tied sum adds whole
    gradients, and ``Pipeline`` refuses a tied parameter that is a DTensor. ``sequence_parallel``: also shard the norms'
    tokens; the sequence length must then be a multiple of the mesh size."""
    from torch.distributed.tensor.parallel import parallelize_module

    t = _styles()
    size = tp_mesh.size()
    named = list(module.items()) if isinstance(module, Mapping) else [("", module)]
    seq = t.shard(1) if sequence_parallel else t.replicate()
    for _, root in named:  # refused before any layer is changed
        for layer in root.modules():
            if isinstance(layer, (DecoderLayer, GPT2Layer)):
                _plan_of(layer)
                _check_heads(layer.config, size)
    for prefix, root in named:
        for name, layer in root.named_modules(prefix=prefix):
            if isinstance(layer, (DecoderLayer, GPT2Layer)):
                parallelize_module(layer, tp_mesh, _plan_of(layer)(sequence_parallel))
                layer.sequence_shards = size if sequence_parallel else 1
            elif name.endswith("embed_tokens") and isinstance(layer, nn.Embedding):
                if not vocab_parallel:
                    if sequence_parallel:
                        parallelize_module(layer, tp_mesh, _ShardOutput(t))
                    continue
                style = t.rowwise(input_layouts=t.replicate(), output_layouts=seq)
                parallelize_module(layer, tp_mesh, style)
            elif name.endswith("lm_head") and isinstance(layer, nn.Linear):
                if not vocab_parallel:
                    if sequence_parallel:
                        parallelize_module(
                            layer,
                            tp_mesh,
                            t.prepare(
                                input_layouts=(seq,),
                                desired_input_layouts=(t.replicate(),),
                                use_local_output=True,
                            ),
                        )
                    continue
                style = t.colwise(input_layouts=seq, output_layouts=t.replicate())
                parallelize_module(layer, tp_mesh, style)
            elif sequence_parallel and name.endswith("model.norm"):
                parallelize_module(layer, tp_mesh, t.sequence(use_local_output=True))


def _plan_of(layer: nn.Module) -> Any:
    """The decoder layer's tensor-parallel plan from its family's row, or its refusal."""
    family: Any = getattr(layer, "family", None)
    if family is None or family.tensor_parallel is None:
        model_type = getattr(layer.config, "model_type", "?")
        reason = family.tensor_parallel_refusal if family is not None else "no family row"
        raise ValueError(f"tensor parallel of {model_type}: {reason}")
    return family.tensor_parallel


def _ShardOutput(t: Any) -> Any:
    """A replicated embedding whose output each rank keeps its sequence shard of."""
    from torch.distributed.tensor.parallel import PrepareModuleOutput

    return PrepareModuleOutput(
        output_layouts=(t.replicate(),),
        desired_output_layouts=(t.shard(1),),
        use_local_output=True,
    )


def _check_heads(config: Any, size: int) -> None:
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, count in (
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("intermediate size", config.intermediate_size),
    ):
        if count % size:
            raise ValueError(
                f"tensor parallel of {size} does not divide the {count} {what}; use a tensor-"
                f"parallel size that divides {heads} heads, {kv_heads} key/value heads and "
                f"intermediate size {config.intermediate_size}"
            )
