"""Per-rank runner for ``from_pretrained(..., recompute=)``: a tiny float64 Llama folder loaded
with some decoder layers recomputing (full or selective), one step on 2 gloo ranks, the loss and
every gradient against ``transformers``' unsplit model, and how often each decoder layer ran."""

from __future__ import annotations

import torch
from hf_cases import _close, batch
from hf_pretrained_cases import reference

#: decoder layers of the folder's model (7 layers in all: embedding, 4 decoder layers, norm, head)
DECODERS = 4

#: (label, schedule, stage_layers, micro-batches, defer_weight_grads, recompute)
CASES = [
    ("zbv deferred", "zbv", [2, 2, 2, 1], 4, True, {0: "full", 1: "selective", 3: "full"}),
    ("zbv replayed", "zbv", [2, 2, 2, 1], 4, False, {0: "selective", 1: "full", 3: "selective"}),
    ("zb-h1 deferred", "zb-h1", [3, 4], 4, True, {2: "full", 3: "selective"}),
    ("1f1b all selective", "1f1b", [3, 4], 4, None, "selective"),
]


def run_recompute(rank: int, world: int, folder: str) -> dict:
    """Per case: failures (loss or gradient unlike the reference, state-dict keys unlike the
    model's), the modes this rank's decoder layers run under and how many times each ran."""
    import pipetrain
    from pipetrain.hf import causal_lm_loss, from_pretrained
    from pipetrain.runtime.backward.activation_checkpoint import Recomputed

    ids = batch(8)
    ref_loss, ref_grads, model = reference(folder, ids)
    names = set(model.state_dict())
    out: dict = {"failures": [], "modes": {}, "calls": {}}
    for label, schedule, cut, m, defer, recompute in CASES:
        stages = from_pretrained(folder, cut, recompute=recompute)
        v = 2 if schedule == "zbv" else 1
        pipe = pipetrain.Pipeline(
            stages, schedule, m, causal_lm_loss, stages_per_rank=v, defer_weight_grads=defer
        )
        modes, calls = {}, {}
        for module in pipe.modules.values():
            for name, (layer, _) in zip(module.layer_names, module.chain, strict=True):
                if ".layers." not in name:
                    continue
                modes[name] = layer.mode if isinstance(layer, Recomputed) else "none"
                inner = layer.layer if isinstance(layer, Recomputed) else layer
                calls[name] = 0
                inner.register_forward_pre_hook(
                    lambda *_, n=name, c=calls: c.__setitem__(n, c[n] + 1)
                )
        loss = pipe.step(ids, ids)
        if not _close(loss, ref_loss):
            out["failures"].append(f"{label}: loss {loss.item()} != {ref_loss.item()}")
        for module in pipe.modules.values():
            if not set(module.state_dict()) <= names:
                out["failures"].append(f"{label}: state-dict keys unlike the model's")
            for n, p in module.named_parameters(remove_duplicate=False):
                if not _close(p.grad, ref_grads[n]):
                    out["failures"].append(f"{label}: {n} gradient differs")
        out["modes"][label], out["calls"][label] = modes, calls
        pipe.close()
    return out


def expected_modes(recompute: str | dict[int, str]) -> dict[str, str]:
    """{decoder layer name: mode} that ``recompute`` asks for."""
    if isinstance(recompute, str):
        return {f"model.layers.{i}": recompute for i in range(DECODERS)}
    return {f"model.layers.{i}": recompute.get(i, "none") for i in range(DECODERS)}


def write_folder(root) -> str:
    from hf_cases import build

    folder = root / "llama"
    torch.manual_seed(0)
    build("llama", DECODERS).save_pretrained(folder)
    return str(folder)
