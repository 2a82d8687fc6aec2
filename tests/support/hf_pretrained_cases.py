"""Per-rank runners for ``pipetrain.hf.from_pretrained`` and ``save_pretrained``.

The folders are tiny random float64 models written by ``transformers``' ``save_pretrained`` (a
single file, or shards of a few kilobytes with an index). The reference is
``AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)``, unsplit, on the same
batch through the same loss; gradients are compared by the model's parameter names.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_cases import _close, batch, build

#: decoder layers of the folders' models: 5 layers in all, enough for 4 stages
BLOCKS = 2


def write_folders(root: Path) -> dict[str, str]:
    """Llama in one file, GPT-2 with tied embeddings in shards with an index."""
    folders = {"llama": root / "llama", "gpt2-tied": root / "gpt2-tied"}
    build("llama", BLOCKS).save_pretrained(folders["llama"])
    build("gpt2-tied", BLOCKS).save_pretrained(folders["gpt2-tied"], max_shard_size="4KB")
    return {kind: str(path) for kind, path in folders.items()}


def even_counts(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (s < extra) for s in range(num_stages)]


def reference(folder: str, ids: torch.Tensor):
    """Loss and gradients (under every parameter name, tied ones included) of the model that
    ``transformers`` loads from ``folder``."""
    from transformers import AutoModelForCausalLM

    from pipetrain.hf import causal_lm_loss

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    loss = causal_lm_loss(model(ids).logits, ids)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return loss.detach(), grads, model


def run_schedules(rank: int, world: int, folders: dict[str, str], names: list[str]) -> list[str]:
    """Every (model, schedule): loss and every local gradient against the reference."""
    import pipetrain
    from pipetrain.hf import causal_lm_loss, from_pretrained
    from pipetrain.schedule.registry import family

    ids = batch()
    failures = []
    for kind, folder in folders.items():
        ref_loss, ref_grads, _ = reference(folder, ids)
        for name in names:
            v = family(name).default_stages_per_rank
            m = 4 * v if name == "dualpipev" else 4
            stages = from_pretrained(folder, even_counts(BLOCKS + 3, world * v))
            pipe = pipetrain.Pipeline(stages, name, m, causal_lm_loss)
            loss = pipe.step(ids, ids)
            case = f"{kind} {name}"
            if not _close(loss, ref_loss):
                failures.append(f"{case}: loss {loss.item()} != {ref_loss.item()}")
            checked = 0
            for module in pipe.modules.values():
                for n, p in module.named_parameters(remove_duplicate=False):
                    checked += 1
                    if not _close(p.grad, ref_grads[n]):
                        failures.append(f"{case}: {n} gradient differs")
            if not checked:
                failures.append(f"{case}: no parameter on rank {rank}")
            pipe.close()
    return failures


def run_export(rank: int, world: int, folders: dict[str, str], out: str) -> list[str]:
    """from_pretrained → a step and an SGD update → save_pretrained: the folder holds the
    trained weights (``transformers`` loads them; so does ``from_pretrained`` at another cut),
    and a DCP checkpoint of the same pipeline loads into a fresh one."""
    from transformers import AutoModelForCausalLM

    import pipetrain
    from pipetrain.hf import causal_lm_loss, from_pretrained, save_pretrained

    ids = batch()
    failures = []
    for kind, folder in folders.items():
        for name in ("1f1b", "zbv"):  # zbv holds the embedding and the head on rank 0
            v = 2 if name == "zbv" else 1
            case = f"{kind} {name}"
            pipe = pipetrain.Pipeline(
                from_pretrained(folder, even_counts(BLOCKS + 3, 2 * v)), name, 4, causal_lm_loss
            )
            pipe.step(ids, ids)
            with torch.no_grad():
                for p in pipe.parameters():
                    p -= 0.1 * p.grad
            trained = pipe.state_dict()
            saved = f"{out}/{kind}-{name}"
            save_pretrained(pipe, saved)
            loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64).state_dict()
            differ = [n for n, t in trained.items() if not torch.equal(t, loaded[n])]
            if differ:
                failures.append(f"{case}: transformers loads other values for {differ[:3]}")
            (whole,) = from_pretrained(saved, [BLOCKS + 3])
            again = whole.state_dict()
            differ = [n for n, t in trained.items() if not torch.equal(t, again[n])]
            if differ:
                failures.append(f"{case}: from_pretrained loads other values for {differ[:3]}")
            checkpoint = f"{out}/{kind}-{name}-dcp"
            pipetrain.save_checkpoint(checkpoint, pipe)
            fresh = pipetrain.Pipeline(
                from_pretrained(folder, even_counts(BLOCKS + 3, 2 * v)), name, 4, causal_lm_loss
            )
            pipetrain.load_checkpoint(checkpoint, fresh)
            differ = [n for n, t in fresh.state_dict().items() if not torch.equal(t, trained[n])]
            if differ:
                failures.append(f"{case}: the DCP checkpoint loads other values for {differ[:3]}")
            pipe.close()
            fresh.close()
    return failures


def run_data_parallel_export(rank: int, world: int, folder: str, out: str) -> list[str]:
    """Llama on a 2 × 2 (dp, pp) mesh under FSDP2 and DDP: a step, an SGD update, then
    save_pretrained from every process; the folder equals the whole trained weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    import pipetrain
    from pipetrain.hf import causal_lm_loss, from_pretrained, save_pretrained

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    ids = batch(8)
    mine = ids[4 * mesh.get_local_rank("dp") :][:4]
    failures = []
    for kind in ("fsdp", "ddp"):
        stages = from_pretrained(folder, even_counts(BLOCKS + 3, 2))
        pipe = pipetrain.Pipeline(stages, "1f1b", 2, causal_lm_loss, mesh=mesh, data_parallel=kind)
        pipe.step(mine, mine)
        with torch.no_grad():
            for p in pipe.parameters():
                p -= 0.1 * p.grad
        whole = {
            n: t.full_tensor() if isinstance(t, DTensor) else t
            for n, t in pipe.state_dict().items()
        }
        saved = f"{out}/{kind}"
        save_pretrained(pipe, saved)
        loaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float64).state_dict()
        differ = [n for n, t in whole.items() if not torch.equal(t, loaded[n])]
        if differ:
            failures.append(f"{kind}: the saved folder differs at {differ[:3]}")
        pipe.close()
    return failures
