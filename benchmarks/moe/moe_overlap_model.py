"""The mixture-of-experts model and the pipelines ``moe_overlap_gpu.py`` compares: presets, the
Qwen3-MoE model built from a ``transformers`` config with seeded random weights, its cut into
stages, each row's ``Pipeline`` on the ``("pp", "edp", "ep")`` mesh, and the batches.

The shape is chosen so the expert all-to-all is a visible share of the step: each token's
dispatch moves top-k copies of its hidden state (``2 · top_k · hidden`` bytes in bf16) for
``6 · top_k · hidden · moe_inter`` expert FLOPs (three GEMMs of ``hidden × moe_inter`` per copy),
so the bytes per expert FLOP are ``1 / (3 · moe_inter)`` whatever the hidden size and top-k.
DeepSeek-V3 (moe_inter 2048) pays that ratio over cross-node links; the presets take an expert
8 times narrower (256) so that NVLink inside one host, several times faster, still leaves the
all-to-all a share of the step worth hiding.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

#: row name → (schedule, overlap_pairs); the order of the first launch
ROWS: dict[str, tuple[str, bool]] = {
    "dualpipev+overlap": ("dualpipev", True),
    "dualpipev": ("dualpipev", False),
    "zbv": ("zbv", False),
    "1f1b": ("1f1b", False),
}
#: model chunks per rank of each schedule (V schedules: two; 1F1B: one)
STAGES_PER_RANK = {"dualpipev": 2, "zbv": 2, "1f1b": 1}


@dataclass(frozen=True)
class Shape:
    """One preset: the model (Qwen3-MoE fields), the mesh, the batch and the run's lengths."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    moe_inter: int
    experts: int
    top_k: int
    vocab: int
    seq: int
    pp: int
    ep: int
    microbatches: int
    mb_size: int
    dtype: str
    steps: int
    warmup: int
    launches: int
    device: str


# 4 GPUs, pp 2 × ep 2: 8 MoE layers (2 per V stage), 64 experts top-8, moe_inter 256
H200X4 = Shape(
    layers=8,
    hidden=2048,
    heads=16,
    kv_heads=4,
    head_dim=128,
    moe_inter=256,
    experts=64,
    top_k=8,
    vocab=32768,
    seq=4096,
    pp=2,
    ep=2,
    microbatches=8,
    mb_size=1,
    dtype="bfloat16",
    steps=20,
    warmup=5,
    launches=3,
    device="cuda",
)

PRESETS: dict[str, Shape] = {
    "h200x4": H200X4,
    # 8 GPUs, pp 2 × ep 4: the same layer, three quarters of the copies leave the rank
    "h200x8": dataclasses.replace(H200X4, ep=4),
    # gloo on CPU: the plumbing only (4 processes, pp 2 × ep 2)
    "cpu-smoke": Shape(
        layers=4,
        hidden=16,
        heads=2,
        kv_heads=1,
        head_dim=8,
        moe_inter=8,
        experts=4,
        top_k=2,
        vocab=64,
        seq=16,
        pp=2,
        ep=2,
        microbatches=4,
        mb_size=1,
        dtype="float32",
        steps=2,
        warmup=1,
        launches=1,
        device="cpu",
    ),
}


def config_of(shape: Shape) -> Any:
    """The ``transformers`` Qwen3-MoE config of ``shape`` (every layer routed, router loss on)."""
    import transformers as tf

    return tf.Qwen3MoeConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=4 * shape.hidden,  # unused: every layer is an MoE layer
        moe_intermediate_size=shape.moe_inter,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.seq,
        num_experts=shape.experts,
        num_experts_per_tok=shape.top_k,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.001,
        tie_word_embeddings=False,
    )


def build_master(shape: Shape, device: torch.device, seed: int = 0) -> dict[str, torch.nn.Module]:
    """The whole model's layers (``pipetrain.hf.causal_lm_layers``) on ``device`` in the preset's
    dtype, every matrix drawn from N(0, 0.02) under ``seed`` (the norms stay ones); every rank
    draws the same weights, and each row copies its stages from these."""
    import transformers as tf

    from pipetrain.hf import causal_lm_layers

    dtype = getattr(torch, shape.dtype)
    with torch.device(device):
        model = tf.AutoModelForCausalLM.from_config(config_of(shape), dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():  # experts start empty and the routers at zero: all drawn
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
    return causal_lm_layers(model.train())


def cut(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage: the decoder layers spread evenly (earlier stages take the remainder),
    the embedding on the first stage, the final norm and the head on the last."""
    base, extra = divmod(num_layers, num_stages)
    if base == 0:
        raise ValueError(f"{num_layers} decoder layers cannot fill {num_stages} stages")
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    sizes[0] += 1  # embedding
    sizes[-1] += 2  # final norm, head
    return sizes


class StageFactory:
    """Stage ``s`` of a row: a deep copy of the master's layers of that stage, its experts
    sharded over ``ep`` (``apply_expert_parallel``), so every row starts from the same weights
    and no two rows share a tensor."""

    def __init__(self, master: dict[str, torch.nn.Module], num_stages: int, mesh: Any) -> None:
        import pipetrain

        self.stages = pipetrain.split(master, cut(len(master) - 3, num_stages))
        self.mesh = mesh

    def __call__(self, s: int) -> torch.nn.Module:
        from pipetrain.runtime.parallel.expert_parallel import apply_expert_parallel

        stage = copy.deepcopy(self.stages[s])
        apply_expert_parallel(stage, self.mesh["edp", "ep"])
        return stage


def make_pipeline(row: str, shape: Shape, master, mesh, device: torch.device, timeout_s: float):
    """The row's ``Pipeline`` (data parallel over ``("edp", "ep")`` with DDP, as the expert
    parallel tests run it); a context manager."""
    import pipetrain
    from pipetrain.hf import causal_lm_loss

    schedule, overlap = ROWS[row]
    v = STAGES_PER_RANK[schedule]
    return pipetrain.Pipeline(
        StageFactory(master, v * shape.pp, mesh),
        schedule,
        shape.microbatches,
        causal_lm_loss,
        stages_per_rank=v,
        num_stages=v * shape.pp,
        mesh=mesh,
        data_parallel="ddp",
        device=device,
        overlap_pairs=overlap,
        timeout=timedelta(seconds=timeout_s),
    )


def make_mesh(shape: Shape, device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if world != shape.pp * shape.ep:
        raise ValueError(
            f"pp {shape.pp} × ep {shape.ep} needs {shape.pp * shape.ep} processes, got {world}; "
            "launch with --nproc-per-node pp·ep (or --pp/--ep that multiply to it)"
        )
    dims = (shape.pp, 1, shape.ep)
    return init_device_mesh(device.type, dims, mesh_dim_names=("pp", "edp", "ep"))


def batch(shape: Shape, replica: int, device: torch.device) -> torch.Tensor:
    """This data-parallel replica's token ids (its own rows: every ep rank steps on its own)."""
    g = torch.Generator().manual_seed(1000 + replica)
    rows = shape.microbatches * shape.mb_size
    return torch.randint(0, shape.vocab, (rows, shape.seq), generator=g).to(device)


def replica_of(mesh) -> int:
    return mesh.get_local_rank("edp") * mesh["ep"].size() + mesh.get_local_rank("ep")
