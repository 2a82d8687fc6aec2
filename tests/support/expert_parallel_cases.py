"""Per-rank runners for the expert-parallel tests (inside processes ``runtime_harness`` spawns).

Every rank builds the same tiny float64 Qwen3-MoE (2 layers, both routed, 4 experts, top-2,
router loss on) and runs it on a ``("pp", "edp", "ep")`` mesh with its experts sharded over
``ep`` (``apply_expert_parallel``), each data-parallel replica on its own rows of the global
batch. The reference is the unsplit ``transformers`` model under gradient accumulation over the
same micro-batches (every replica's, in order), each MoE layer adding its balancing term per
micro-batch (``pipetrain.hf.router_losses``): loss, the gradient norm and every gradient (an
expert shard against its slice) to 1e-10 after clipping, the reported router loss to float32's
resolution (``transformers`` computes it in float32).
"""

from __future__ import annotations

import importlib

import torch

VOCAB, SEQ, ROWS_PER_MB, M = 41, 5, 1, 4  # dualpipev: M >= 2·pp
EXPERTS, TOP_K, COEF = 4, 2, 0.25
CUT = [2, 1, 1, 1]  # embedding + layer 0 | layer 1 | norm | head: routed layers on both ranks
MAX_NORM = 0.05  # small enough to clip


def build(layers: int = 2):
    """The model (``layers`` decoder layers, every one routed)."""
    import transformers as tf

    config = tf.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=12,
        moe_intermediate_size=6,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=16,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=COEF,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        experts_implementation="eager",  # grouped_mm takes no float64
    )
    torch.manual_seed(7)
    model = tf.AutoModelForCausalLM.from_config(config).double()
    with torch.no_grad():  # routers start near zero: widen them so routing is decided
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.train()


def batch(replicas: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and a 0/1 mask for ``replicas × M`` micro-batches, some tokens padded."""
    rows = replicas * M * ROWS_PER_MB
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, VOCAB, (rows, SEQ), generator=g)
    mask = torch.ones(rows, SEQ, dtype=torch.long)
    mask[0, :2] = 0
    mask[-1, -1] = 0
    return ids, mask


def mean_loss(logits, targets):
    """The token mean of one micro-batch (``loss_reduction="mean"``: replicas averaged)."""
    from pipetrain.hf import causal_lm_token_loss

    return causal_lm_token_loss(logits, targets) / (targets != -100).sum()


def reference(
    replicas: int, reduction: str, layers: int = 2
) -> tuple[torch.Tensor, float, torch.Tensor, dict]:
    """(loss, router loss as reported, clipped norm, clipped gradients) of the unsplit model,
    one step of gradient accumulation over every replica's micro-batches in order: the global
    token mean (``"token_mean"``) or the mean of the micro-batches' token means (``"mean"``)."""
    from pipetrain.hf import causal_lm_token_loss, next_token_targets
    from pipetrain.hf.families import family_of

    model = build(layers)
    balance = importlib.import_module(family_of(model).balancing).load_balancing_loss_func
    ids, mask = batch(replicas)
    targets = next_token_targets(ids, attention_mask=mask)
    count = (targets != -100).sum()
    micro = replicas * M
    loss = torch.zeros((), dtype=torch.float64)
    router = 0.0
    for j in range(micro):
        part = slice(j * ROWS_PER_MB, (j + 1) * ROWS_PER_MB)
        out = model(ids[part], attention_mask=mask[part], output_router_logits=True)
        terms = [balance((r,), EXPERTS, TOP_K, mask[part]) for r in out.router_logits]
        aux = COEF * torch.stack(terms).sum()
        if reduction == "mean":
            main = mean_loss(out.logits, targets[part]) / micro
        else:
            main = causal_lm_token_loss(out.logits, targets[part]) / count
        (main + aux / micro).backward()
        loss += main.detach()
        router += aux.item() / micro
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss, router, norm, grads


def _close(a, b, rtol: float = 1e-10) -> bool:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return bool((a - b).norm() <= rtol * b.norm() + 1e-14)


def ep_pipeline(mesh, schedule: str, reduction: str, data_parallel: str = "ddp"):
    """The model on ``mesh`` (``("pp", "edp", "ep")``), experts sharded over ``ep``."""
    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_token_loss
    from pipetrain.runtime.parallel.expert_parallel import apply_expert_parallel

    layers = causal_lm_layers(build())
    sharded = apply_expert_parallel(layers.values(), mesh["edp", "ep"])
    assert sharded == 2, sharded
    stages = pipetrain.split(layers, CUT)
    return pipetrain.Pipeline(
        stages,
        schedule,
        M,
        mean_loss if reduction == "mean" else causal_lm_token_loss,
        loss_reduction=reduction,
        stages_per_rank=2,
        mesh=mesh,
        data_parallel=data_parallel,
    )


def step_and_compare(pipe, mesh, schedule: str, ref, failures: list[str]) -> None:
    """One step on this replica's rows, clipped; every number against ``ref``."""
    from pipetrain.hf import ROUTER_AUX_LOSS, next_token_targets

    ref_loss, ref_router, ref_norm, ref_grads = ref
    dp = mesh["edp", "ep"]
    replicas = dp.size()
    replica = mesh.get_local_rank("edp") * mesh["ep"].size() + mesh.get_local_rank("ep")
    ids, mask = batch(replicas)
    targets = next_token_targets(ids, attention_mask=mask)
    mine = slice(replica * M * ROWS_PER_MB, (replica + 1) * M * ROWS_PER_MB)
    loss = pipe.step(ids[mine], targets[mine], side={"attention_mask": mask[mine]})
    if not _close(loss, ref_loss):
        failures.append(f"{schedule}: loss {loss.item()} != {ref_loss.item()}")
    router = pipe.extra_losses.get(ROUTER_AUX_LOSS, float("nan"))
    # transformers' balancing function counts and averages in float32 (its ``.float()``): the
    # experts' GEMMs over other row sets round the float64 logits' last bit otherwise, which
    # can move one float32 rounding; its gradients below are float64 and held to 1e-10
    if not _close(router, ref_router, 1e-6):
        failures.append(f"{schedule}: router loss {router} != {ref_router}")
    norm = pipe.clip_grad_norm_(MAX_NORM)
    if not _close(norm, ref_norm):
        failures.append(f"{schedule}: gradient norm {norm.item()} != {ref_norm.item()}")
    for module in pipe.modules.values():
        for name, p in module.named_parameters():
            failures.extend(_grad_differs(schedule, name, p, ref_grads[name]))


def _grad_differs(schedule: str, name: str, p, ref) -> list[str]:
    """A gradient against the reference's (a shard against its slice of the experts)."""
    from torch.distributed.tensor import DTensor

    grad = p.grad
    if isinstance(grad, DTensor) and "ep" not in (grad.device_mesh.mesh_dim_names or ()):
        grad = grad.full_tensor()  # FSDP2's shard of a dense parameter (collective)
    if isinstance(grad, DTensor):
        local = grad.to_local()
        ep_rank = grad.device_mesh.get_local_rank("ep")
        ref = ref[ep_rank * local.shape[0] : (ep_rank + 1) * local.shape[0]]
        grad = local
    if grad is None or not _close(grad, ref):
        return [f"{schedule}: {name} gradient differs"]
    return []


def run_exact(
    rank: int, world: int, edp: int, ep: int, cases: list[tuple[str, str, str]]
) -> list[str]:
    """Each (schedule, loss reduction, data parallel) on a pp 2 × (edp × ep) mesh against the
    unsplit reference."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, edp, ep), mesh_dim_names=("pp", "edp", "ep"))
    failures: list[str] = []
    for schedule, reduction, kind in cases:
        ref = reference(edp * ep, reduction)
        with ep_pipeline(mesh, schedule, reduction, kind) as pipe:
            step_and_compare(pipe, mesh, f"{schedule} {reduction} {kind}", ref, failures)
    return failures


def _whole(state: dict) -> dict:
    """A state dict's tensors whole (a DTensor gathered: collective, in the dict's order)."""
    from torch.distributed.tensor import DTensor

    return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in state.items()}


def run_reshard(rank: int, world: int, out: str) -> list[str]:
    """Under DDP and under FSDP2: a step and an SGD update at ep 2 (pp 2 × ep 2), then a DCP
    checkpoint loaded by the same model at ep 1 (pp 2 × dp 2 under DDP, experts whole) and a
    Hugging Face export ``transformers`` loads: both hold the trained values exactly."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "edp", "ep"))
    plain = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    failures: list[str] = []
    for kind in ("ddp", "fsdp"):
        failures += _reshard(mesh, plain, kind, f"{out}/{kind}")
    return failures


def _reshard(mesh, plain, kind: str, out: str) -> list[str]:
    from transformers import AutoModelForCausalLM

    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_token_loss, save_pretrained

    failures: list[str] = []
    with ep_pipeline(mesh, "zbv", "token_mean", kind) as pipe:
        step_and_compare(pipe, mesh, "zbv before the checkpoint", reference(2, "token_mean"), [])
        with torch.no_grad():
            for p in pipe.parameters():
                p -= 0.1 * p.grad
        trained = _whole(pipe.state_dict())
        pipetrain.save_checkpoint(f"{out}/dcp", pipe)
        save_pretrained(pipe, f"{out}/hf", config=build().config)
    stages = pipetrain.split(causal_lm_layers(build()), CUT)
    with pipetrain.Pipeline(
        stages,
        "zbv",
        M,
        causal_lm_token_loss,
        stages_per_rank=2,
        mesh=plain,
        data_parallel="ddp",
    ) as fresh:
        pipetrain.load_checkpoint(f"{out}/dcp", fresh)
        for name, value in fresh.state_dict().items():
            if not torch.equal(value, trained[name]):
                failures.append(f"{kind}: ep 1 loads another {name}")
    loaded = AutoModelForCausalLM.from_pretrained(
        f"{out}/hf", dtype=torch.float64, experts_implementation="eager"
    ).state_dict()
    for name, value in trained.items():
        if not torch.equal(value, loaded[name]):
            failures.append(f"{kind}: transformers loads another {name}")
    return failures


def family_model(kind: str):
    """A tiny float64 model of ``kind`` with 4 experts, top-2 (Qwen2-MoE with its shared expert,
    GPT-OSS with its biases and clamped, interleaved gate, DeepSeek-V3 with its dense first
    layer, grouped routing and routing bias)."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=8,
        intermediate_size=12,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        num_experts_per_tok=TOP_K,
        output_router_logits=False,
        experts_implementation="eager",
    )
    if kind == "deepseek_v3":  # a dense first layer, then one with grouped routing, a bias
        config = tf.DeepseekV3Config(
            **(common | {"num_hidden_layers": 2, "num_key_value_heads": 2}),
            n_routed_experts=EXPERTS,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            n_shared_experts=1,
            moe_intermediate_size=6,
            kv_lora_rank=4,
            q_lora_rank=4,
            qk_rope_head_dim=2,
            qk_nope_head_dim=2,
            v_head_dim=2,
            num_nextn_predict_layers=0,
        )
    elif kind == "mixtral":
        config = tf.MixtralConfig(**common, num_local_experts=EXPERTS)
    elif kind == "gpt_oss":
        config = tf.GptOssConfig(**common, num_local_experts=EXPERTS, head_dim=4, sliding_window=3)
    else:
        config = tf.Qwen2MoeConfig(
            **common,
            num_experts=EXPERTS,
            moe_intermediate_size=6,
            shared_expert_intermediate_size=6,
        )
    torch.manual_seed(7)
    model = tf.AutoModelForCausalLM.from_config(config).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "router" in name or name.endswith(
                ("mlp.gate.weight", "block_sparse_moe.gate.weight")
            ):
                p.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)
            elif "experts" in name:
                p.normal_(0.0, 0.3)  # GPT-OSS's start empty
    return model.train()


def run_families(rank: int, world: int, kinds: list[str]) -> list[str]:
    """Each family's model on 2 ranks with its experts sharded over ep 2, each rank on its own
    rows: its logits equal the unsplit model's on those rows; an expert shard's gradient (every
    rank's tokens reach it) equals the unsplit model's over both ranks' rows, and so does each
    dense gradient summed over the ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import pipetrain
    from pipetrain.hf import causal_lm_layers
    from pipetrain.runtime.parallel.expert_parallel import apply_expert_parallel

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("edp", "ep"))
    ids, mask = batch(world)
    ids, mask = ids.repeat(1, 2)[:, :SEQ], mask  # a few more routed tokens per rank
    rows = ids.shape[0] // world
    mine = slice(rank * rows, (rank + 1) * rows)
    failures: list[str] = []
    for kind in kinds:
        reference = family_model(kind)
        # each rank's rows on their own (DeepSeek-V3's router runs in float32, whose products
        # depend on how many rows they are taken over), gradients accumulated over both
        parts = [slice(r * rows, (r + 1) * rows) for r in range(world)]
        logits = torch.cat([reference(ids[p], attention_mask=mask[p]).logits for p in parts])
        (logits**2).sum().backward()
        theirs = dict(reference.named_parameters())
        layers = causal_lm_layers(family_model(kind))
        if apply_expert_parallel(layers.values(), mesh) != 1:
            failures.append(f"{kind}: its experts were not sharded")
            continue
        (stage,) = pipetrain.split(layers, [len(layers)])
        out = stage(ids[mine], attention_mask=mask[mine])
        (out**2).sum().backward()
        if not _close(out, logits[mine].detach()):
            failures.append(f"{kind}: logits differ")
        for name, p in stage.named_parameters():
            ref = theirs[name].grad
            if isinstance(p.grad, DTensor):
                local = p.grad.to_local()
                ref = ref[rank * local.shape[0] : (rank + 1) * local.shape[0]]
            else:
                local = p.grad.clone()
                torch.distributed.all_reduce(local)
            if not _close(local, ref):
                failures.append(f"{kind}: {name} gradient differs")
    return failures


#: the lane tests' model: 4 decoder layers, one per stage (the first with the embedding, the
#: last with the norm and head), so that both parts of every DualPipeV pair exchange tokens
LANE_LAYERS, LANE_CUT = 4, [2, 1, 1, 3]
#: per stage of ``LANE_CUT``: its decoder layer recomputed, fully or selectively
RECOMPUTE = ["full", "selective", "full:1", "selective:1"]


def lanes_pipeline(mesh, case: dict):
    """``ep_pipeline``'s model under ``case``: ``schedule``, ``reduction``, ``kind`` (data
    parallel), ``overlap`` (``overlap_pairs``), ``recompute`` (``RECOMPUTE``, per layer) and
    ``defer`` (``defer_weight_grads``: True, the zero-bubble paper's I/W; False, graph replay)."""
    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_token_loss
    from pipetrain.runtime.parallel.expert_parallel import apply_expert_parallel

    layers = causal_lm_layers(build(LANE_LAYERS))
    assert apply_expert_parallel(layers.values(), mesh["edp", "ep"]) == LANE_LAYERS
    recompute = RECOMPUTE if case["recompute"] else None
    stages = pipetrain.split(layers, LANE_CUT, recompute=recompute)
    reduction = case["reduction"]
    return pipetrain.Pipeline(
        stages,
        case["schedule"],
        M,
        mean_loss if reduction == "mean" else causal_lm_token_loss,
        loss_reduction=reduction,
        stages_per_rank=2,
        mesh=mesh,
        data_parallel=case["kind"],
        overlap_pairs=case["overlap"],
        defer_weight_grads=case["defer"],
    )


def run_lanes(rank: int, world: int, cases: list[dict]) -> dict:
    """Each case on pp 2 × ep 2 (dp 2 = ep 2) against the unsplit reference; per case the
    failures and, with ``overlap``, the spans of this rank's stage pieces (``pair_lanes_cases``)
    and the pairs of its program row."""
    from pair_lanes_cases import pairs_of, recording_spans
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "edp", "ep"))
    out: dict = {}
    for case in cases:
        label = " ".join(f"{k}={v}" for k, v in case.items())
        failures: list[str] = []
        ref = reference(2, case["reduction"], LANE_LAYERS)
        with lanes_pipeline(mesh, case) as pipe, recording_spans() as spans:
            step_and_compare(pipe, mesh, label, ref, failures)
            pairs = pairs_of(pipe)
        out[label] = {"failures": failures, "spans": spans, "pairs": pairs}
    return out
