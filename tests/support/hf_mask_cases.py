"""Padded and packed batches through ``pipetrain.hf``'s layers: the side inputs, the targets, and
a per-rank runner against the unsplit ``transformers`` model given the same inputs.

Rows carry different numbers of real tokens, so micro-batches do too: a loss normalised per
micro-batch would be off, the token mean over the whole batch is not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hf_cases import SEQ, _close, batch, build

ROWS = 8


def side_inputs(variant: str) -> dict[str, torch.Tensor]:
    """``left`` / ``right`` padding (0 to 3 pad tokens a row) or ``packed`` documents."""
    from pipetrain.hf import packed_position_ids

    if variant == "packed":
        lengths = [[3, 5], [8], [2, 2, 4], [1, 7], [4], [5, 3], [2, 6], [6]]
        return {"position_ids": packed_position_ids(lengths, SEQ)}
    mask = torch.ones(ROWS, SEQ, dtype=torch.long)
    for r in range(ROWS):
        pads = r % 4
        if pads:
            if variant == "left":
                mask[r, :pads] = 0
            else:
                mask[r, SEQ - pads :] = 0
    return {"attention_mask": mask}


def reference(kind: str, layers: int, ids: torch.Tensor, side: dict, targets: torch.Tensor):
    """The unsplit model on the same inputs (no KV cache, as in training): the token mean of
    the cross entropy over the counted targets, and the gradients."""
    model = build(kind, layers)
    logits = model(ids, **side, use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def run_masked(rank: int, world: int, plans: list[tuple[str, str, list[str]]]) -> list[str]:
    """``plans``: (model kind, side-input variant, schedules)."""
    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_token_loss, next_token_targets
    from pipetrain.schedule.registry import family

    ids = batch(ROWS)
    layers = 2  # 5 layers: enough for 4 stages
    failures = []
    for kind, variant, names in plans:
        side = side_inputs(variant)
        targets = next_token_targets(ids, **side)
        for name in names:
            v = family(name).default_stages_per_rank
            ref_loss, ref_grads = reference(kind, layers, ids, side, targets)
            model = build(kind, layers)
            stages = pipetrain.split(causal_lm_layers(model), _even(layers + 3, world * v))
            m = 4 * v if name == "dualpipev" else 4  # DualPipeV: 2 × stages micro-batches
            pipe = pipetrain.Pipeline(stages, name, m, causal_lm_token_loss)
            loss = pipe.step(ids, targets, side=side)
            case = f"{kind} {variant} {name}"
            if not _close(loss, ref_loss):
                failures.append(f"{case}: loss {loss.item()} != {ref_loss.item()}")
            failures += gradient_failures(case, model, pipe, ref_grads)
            pipe.close()
    return failures


def gradient_failures(case: str, model, pipe, ref_grads: dict) -> list[str]:
    """The parameters of ``model`` held by this rank's ``pipe`` whose gradient differs from the
    unsplit model's (``ref_grads`` by name)."""
    local = {id(p) for p in pipe.parameters()}
    return [
        f"{case}: {n} gradient differs"
        for n, p in model.named_parameters()
        if id(p) in local and not _close(p.grad, ref_grads[n])
    ]


def _even(num_layers: int, num_stages: int) -> list[int]:
    base, extra = divmod(num_layers, num_stages)
    return [base + (s < extra) for s in range(num_stages)]
