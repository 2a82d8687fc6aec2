"""Tiny random ``transformers`` models (no downloads) and per-rank runners for the HF tests.

Every rank builds the same float64 model (seeded), cuts ``pipetrain.hf.causal_lm_layers`` into
stages and trains one step; the reference is the unsplit ``transformers`` model on the same
batch, its logits through the same loss. Gradients are compared by the model's parameter names.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, SEQ, ROWS = 61, 8, 9


def build(kind: str, layers: int = 2) -> nn.Module:
    """A tiny model of ``kind`` (float64, dropout off), the same on every call."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    if kind == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif kind == "qwen3":
        config, cls = tf.Qwen3Config(**common, head_dim=4), tf.Qwen3ForCausalLM
    elif kind == "qwen2-sliding":  # layer 0 full attention, the others a window of 3
        config = tf.Qwen2Config(
            **common, use_sliding_window=True, sliding_window=3, max_window_layers=1
        )
        cls = tf.Qwen2ForCausalLM
    elif kind == "mistral":
        config, cls = tf.MistralConfig(**common, sliding_window=3), tf.MistralForCausalLM
    elif kind in ("gpt2", "gpt2-tied"):
        config = tf.GPT2Config(
            vocab_size=VOCAB,
            n_embd=16,
            n_layer=layers,
            n_head=4,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=1,
            tie_word_embeddings=kind == "gpt2-tied",
        )
        cls = tf.GPT2LMHeadModel
    else:
        raise ValueError(kind)
    torch.manual_seed(11)
    return cls(config).double()


def batch(rows: int = ROWS) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(3))


def reference(kind: str, layers: int, ids: torch.Tensor):
    from pipetrain.hf import causal_lm_loss

    model = build(kind, layers)
    loss = causal_lm_loss(model(ids).logits, ids)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def cut(layers: list[nn.Module], num_stages: int) -> list[nn.Module]:
    """Consecutive layers, as evenly as possible (until ``pipetrain.split`` is in this branch)."""
    base, extra = divmod(len(layers), num_stages)
    stages, start = [], 0
    for s in range(num_stages):
        n = base + (s < extra)
        stages.append(nn.Sequential(*layers[start : start + n]))
        start += n
    return stages


def _close(a, b, rtol=1e-10) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool((a - b).norm() <= rtol * b.norm() + 1e-14)


def run_schedules(rank: int, world: int, plans: list[tuple[int, str, list[str]]]) -> list[str]:
    """``plans``: (pipeline size, model kind, schedules). A pipeline of 2 runs on each half of
    the 4 ranks at once (ranks 0-1 and 2-3, both the same plan)."""
    import torch.distributed as dist

    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_loss
    from pipetrain.schedule.registry import family

    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ids = batch()
    failures = []
    for size, kind, names in plans:
        if size == "2x2":  # a (dp, pp) mesh: kind is "ddp" or "fsdp"
            failures += _on_mesh(kind, names)
            continue
        group = None if size == world else halves[rank // size]
        most = max(2 * family(n).default_stages_per_rank for n in names) * size // 2
        layers = max(most - 3, 1)  # embedding, norm and head are layers too
        ref_loss, ref_grads = reference(kind, layers, ids)
        for name in names:
            v = family(name).default_stages_per_rank
            m = 4 * v if name == "dualpipev" else 4  # DualPipeV needs 2 × stages micro-batches
            model = build(kind, layers)
            stages = cut(list(causal_lm_layers(model).values()), size * v)
            pipe = pipetrain.Pipeline(stages, name, m, causal_lm_loss, group=group)
            loss = pipe.step(ids, ids)
            case = f"{kind} {name} ranks={size}"
            if not _close(loss, ref_loss):
                failures.append(f"{case}: loss {loss.item()} != {ref_loss.item()}")
            local = {id(p) for p in pipe.parameters()}
            checked = 0
            for n, p in model.named_parameters():
                if id(p) in local:
                    checked += 1
                    if not _close(p.grad, ref_grads[n]):
                        failures.append(f"{case}: {n} gradient differs")
            if not checked:
                failures.append(f"{case}: no parameter on rank {rank}")
    failures += _padded_labels_refused(pipe, ids)
    return failures


def _padded_labels_refused(pipe, ids) -> list[str]:
    """Labels with -100 are refused by ``causal_lm_loss``'s host-side check, on every rank
    before the step's actions (the loss itself no longer looks)."""
    labels = ids.clone()
    labels[0, -1] = -100
    try:
        pipe.step(ids, labels)
    except ValueError as e:
        return [] if "ignore_index" in str(e) else [f"-100 labels refused with: {e}"]
    return ["labels with -100 were not refused"]


def _on_mesh(data_parallel: str, names: list[str]) -> list[str]:
    """Llama on a 2 × 2 ("dp", "pp") mesh: each replica steps on half the rows of a global
    batch; loss and gradients against the unsplit model on the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_loss
    from pipetrain.schedule.registry import family

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(5))
    mine = ids[4 * mesh.get_local_rank("dp") :][:4]
    failures = []
    for name in names:
        num_stages = 2 * family(name).default_stages_per_rank
        layers = max(num_stages - 3, 1)
        ref_loss, ref_grads = reference("llama", layers, ids)
        model = build("llama", layers)
        stages = cut(list(causal_lm_layers(model).values()), num_stages)
        pipe = pipetrain.Pipeline(
            stages, name, 2, causal_lm_loss, mesh=mesh, data_parallel=data_parallel
        )
        loss = pipe.step(mine, mine)
        case = f"llama {data_parallel} {name} dp=2 pp=2"
        if not _close(loss, ref_loss):
            failures.append(f"{case}: loss {loss.item()} != {ref_loss.item()}")
        local = {id(p) for p in pipe.parameters()}
        for n, p in model.named_parameters():
            if id(p) in local:
                grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                if not _close(grad, ref_grads[n]):
                    failures.append(f"{case}: {n} gradient differs")
    return failures
