"""The Megatron-Core row of ``moe_overlap_gpu.py``: its combined 1F1B (interleaved 1F1B with
``overlap_moe_expert_parallel_comm=True``, Megatron's own all-to-all overlap, which needs
pp > 1 with virtual stages and ep > 1) on the same Qwen3-MoE. Not built yet: this row probes
what the machine allows and records why it does not run, naming the fallback incumbent.

What the probe found while this was written (megatron-core 0.19.2, the version
``benchmarks/incumbents`` carries):

* it needs Python ≥ 3.12 (the CPU venv here is 3.11: no wheel installs) and imports ``triton``
  at ``megatron.core`` import (its MoE paged-stash kernels), which the CPU venv lacks; so the
  same model could not be built on the CPU first, as the issue asks;
* its grouped-GEMM experts are ``TEGroupedMLP`` (Transformer Engine's grouped linear); without
  Transformer Engine the GPT layer specs fall back to ``SequentialMLP``, a loop over experts,
  and the GPU image has neither Transformer Engine nor apex. An equal-kernel comparison there
  would put pipetrain on its per-expert loop too (``MoeDecoderLayer.experts_choice = "loop"``);
* the combined 1F1B path itself (``pipeline_parallel/combined_1f1b.py``,
  ``models/gpt/fine_grained_callables.py``) imports no Transformer Engine module, so it may
  run with the local spec (``SequentialMLP``, unfused attention, torch RMSNorm) once the
  weights are copied by name from ``transformers``' Qwen3-MoE (its q/k norms included) and the
  routing is made equal (``moe_router_force_load_balancing`` on both sides if it cannot match).

The fallback the issue names is torchtitan 0.3.0's Qwen3 MoE with expert and pipeline parallel;
it is not built here either. The probe below runs on every rank: the import, Transformer
Engine's presence, and Megatron's own validation of the configuration the row would use
(``TransformerConfig.__post_init__``), so the row's error says which of these stops it.
"""

from __future__ import annotations

import importlib.util
from typing import Any

MEGATRON_ROW = "megatron-combined-1f1b"
FALLBACK = (
    "torchtitan 0.3.0's Qwen3 MoE with expert and pipeline parallel (not built here): the "
    "incumbent to use where Megatron-Core's combined 1F1B cannot run"
)


def megatron_config(shape: Any) -> Any:
    """Megatron's ``TransformerConfig`` for the preset's model under its combined 1F1B: pp
    with two virtual stages per rank, ep, the alltoall dispatcher, bf16 (its validation runs
    here)."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads,
        kv_channels=shape.head_dim,
        ffn_hidden_size=4 * shape.hidden,
        num_moe_experts=shape.experts,
        moe_router_topk=shape.top_k,
        moe_ffn_hidden_size=shape.moe_inter,
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.001,
        normalization="RMSNorm",
        qk_layernorm=True,
        gated_linear_unit=True,
        add_bias_linear=False,
        pipeline_model_parallel_size=shape.pp,
        virtual_pipeline_model_parallel_size=2,
        expert_model_parallel_size=shape.ep,
        overlap_moe_expert_parallel_comm=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )


def probe(shape: Any) -> tuple[str, dict]:
    """(why the row does not run, what was found): the import, Transformer Engine, apex, and
    Megatron's validation of the row's configuration."""
    found: dict[str, object] = {
        "transformer_engine": importlib.util.find_spec("transformer_engine") is not None,
        "apex": importlib.util.find_spec("apex") is not None,
    }
    try:
        import megatron.core as mcore
    except Exception as e:  # ImportError, or one of its imports' (triton) failing
        found["megatron_core"] = f"{type(e).__name__}: {e}"
        return f"megatron-core does not import: {type(e).__name__}: {e}", found
    found["megatron_core"] = getattr(mcore, "__version__", "unknown")
    try:
        megatron_config(shape)
        found["config"] = "valid"
    except Exception as e:  # Megatron validates with asserts and ValueErrors
        found["config"] = f"{type(e).__name__}: {e}"
        return f"Megatron refuses the configuration: {type(e).__name__}: {e}", found
    experts = "TEGroupedMLP" if found["transformer_engine"] else "SequentialMLP (loop)"
    found["experts"] = experts
    return (
        f"not built: the Megatron-Core model (weights copied by name, routing made equal) is "
        f"still to write; its experts here would be {experts}"
    ), found


def megatron_row(run: Any) -> dict:
    """The row: an ``error`` with the probe's reason, what it found, and the fallback."""
    reason, found = probe(run.shape)
    return {"error": reason.splitlines()[0][:300], "probe": found, "fallback": FALLBACK}
