"""Per-rank runner for the Llama family's tensor-parallel plan under the pipeline: a tiny float64
``transformers`` Llama, ``pipetrain.hf.parallelize_causal_lm`` on ``mesh["tp"]``, cut by
``pipetrain.split`` and run by ``Pipeline(mesh=...)``; compared with the unsplit, unparallelized
model on the same batch (loss, every gradient, the clipped norm, the parameters after AdamW)."""

from __future__ import annotations

import torch
from hf_cases import SEQ, batch, build
from runtime_cases import _error_of

BLOCKS = 4
STEPS = 2
MAX_NORM = 0.05


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def reference():
    from pipetrain.hf import causal_lm_loss

    model = build("llama", BLOCKS)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    losses, norms, grads = [], [], {}
    for step in range(STEPS):
        ids = batch(8) if step == 0 else batch(8).roll(1, 1)
        loss = causal_lm_loss(model(ids).logits, ids)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, norms, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def run_case(mesh, case: dict, want) -> list[str]:
    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_loss, parallelize_causal_lm

    want_losses, want_norms, want_grads, want_params = want
    layers = causal_lm_layers(build("llama", BLOCKS))
    parallelize_causal_lm(
        layers,
        mesh["tp"],
        sequence_parallel=case.get("sequence_parallel", False),
        vocab_parallel=case.get("vocab_parallel", True),
    )
    pipe = pipetrain.Pipeline(
        pipetrain.split(layers, case["stage_layers"]),
        case["schedule"],
        4,
        causal_lm_loss,
        mesh=mesh,
        defer_weight_grads=case.get("defer"),
        device="cpu",
    )
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.02)
    failures = []
    for step in range(STEPS):
        ids = batch(8) if step == 0 else batch(8).roll(1, 1)
        loss = pipe.step(ids, ids)
        if abs(float(loss - want_losses[step])) > 1e-12:
            failures.append(f"{case} step {step}: loss {float(loss)} vs {float(want_losses[step])}")
        named = [
            (n, p) for s in sorted(pipe.modules) for n, p in pipe.modules[s].named_parameters()
        ]
        if step == 0:
            for name, p in named:
                d = float((_full(p.grad) - want_grads[name]).abs().max())
                if d > 1e-12:
                    failures.append(f"{case}: grad {name} differs by {d:.3g}")
        norm = pipe.clip_grad_norm_(MAX_NORM)
        if abs(float(norm) - float(want_norms[step])) > 1e-12:
            failures.append(f"{case} step {step}: norm {float(norm)} vs {float(want_norms[step])}")
        opt.step()
        opt.zero_grad()
    for name, p in named:
        d = float((_full(p.detach()) - want_params[name]).abs().max())
        if d > 1e-12:
            failures.append(f"{case}: parameter {name} differs by {d:.3g} after {STEPS} steps")
    pipe.close()
    return failures


def export_differences(mesh, out: str) -> list[str]:
    """``save_pretrained`` of a (pp=2, tp=2) pipeline: the folder ``transformers`` loads holds
    the pipeline's whole weights."""
    import transformers

    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_loss, parallelize_causal_lm
    from pipetrain.hf.export import save_pretrained

    model = build("llama", BLOCKS)
    layers = causal_lm_layers(model)
    parallelize_causal_lm(layers, mesh["tp"], sequence_parallel=True)
    pipe = pipetrain.Pipeline(pipetrain.split(layers, [4, 3]), "1f1b", 2, causal_lm_loss, mesh=mesh)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.02)
    pipe.step(batch(8), batch(8))
    opt.step()
    save_pretrained(pipe, out, config=model.config)
    mine = {n: _full(p.detach()) for s in pipe.modules.values() for n, p in s.named_parameters()}
    pipe.close()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64)
    theirs = dict(loaded.named_parameters())
    return [f"export: {n}" for n, t in mine.items() if not torch.equal(t, theirs[n].detach())]


def run_hf_tensor_parallel(rank: int, world: int, cases: list[dict], out: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from pipetrain.hf import causal_lm_layers, parallelize_causal_lm

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    want = reference()
    failures = []
    for case in cases:
        try:
            failures += run_case(mesh, case, want)
        except Exception as e:  # later cases would wait on a peer
            failures.append(f"{case}: {type(e).__name__}: {e}")
            break
    failures += export_differences(mesh, out)
    errors = {
        "gpt2": _error_of(
            lambda: parallelize_causal_lm(causal_lm_layers(build("gpt2", 2)), mesh["tp"])
        ),
    }
    # what travels between stages under sequence parallel: each rank's shard of the tokens
    layers = causal_lm_layers(build("llama", BLOCKS))
    parallelize_causal_lm(layers, mesh["tp"], sequence_parallel=True)
    ids = batch(8)
    hidden = layers["model.layers.0"](layers["model.embed_tokens"](ids))
    return {"failures": failures, "errors": errors, "wire": tuple(hidden.shape), "seq": SEQ}
