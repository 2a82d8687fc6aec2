"""Per-rank cases for checkpoints of the training tests' model (``training_cases``): save at one
layout, resume at others and in the plain model, and what loading the wrong model says."""

from __future__ import annotations

import torch
from runtime_cases import _error_of
from torch import nn
from training_cases import IGNORE, Block, Embed, Head, batch, build_layers

CKPT_LAYERS = 6  # embed, 4 blocks, head (untied: see run_checkpoints)
CKPT_MB = 4
BEFORE, AFTER = 2, 2  # steps before the checkpoint and after it


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)


def _train_pipeline(pipe, opt, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        tokens, targets, mask = batch(9, seed=100 + step)
        pipe.step(tokens, targets, side={"attention_mask": mask})
        opt.step()


def _pipeline(group, schedule: str, counts: list[int]):
    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy

    stages = pipetrain.split(build_layers(CKPT_LAYERS, tie=False, seed=7), counts)
    pipe = pipetrain.Pipeline(stages, schedule, CKPT_MB, TokenCrossEntropy(IGNORE), group=group)
    return pipe, _adamw(pipe.parameters())


def _snapshot(modules) -> dict:
    """Parameters by name as numpy arrays (tensors would travel back through shared memory
    that dies with the worker)."""
    return {n: t.detach().numpy().copy() for m in modules for n, t in m.state_dict().items()}


def _layer_factory(index: int) -> nn.Module:
    if index == 0:
        return Embed()
    return Head(None) if index == CKPT_LAYERS - 1 else Block()


def run_checkpoints(rank: int, world: int, path: str) -> dict:
    """Save at pp=2 (zbv, 4 stages) after ``BEFORE`` steps; continue there (the uninterrupted
    run), at pp=2 again (ranks 2, 3), at pp=4 (1f1b, another cut) and in the plain model; the
    saved parameters and every run's final ones by name. The test compares the same layout bit
    for bit and the others to float64 round-off.

    The model is untied (the default backward split: the stages where linears hold at least half
    the parameters defer their weight GEMMs, the others replay the graph), so each parameter's
    gradient is the sum of the same terms in the same order whatever the cut (a tied weight's two
    halves are summed in an order that depends on where the cut puts them: docs/training.md).
    Another cut may still round differently: where it moves a block between a deferring stage,
    which accumulates a micro-batch's ``dW`` inside the GEMM (``addmm_``), and graph replay or the
    plain model (a GEMM, then an add), a BLAS that folds ``.grad`` into the GEMM's sums rounds
    otherwise than one that adds it after."""
    import torch.distributed as dist

    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy

    out: dict = {}
    first, second = dist.new_group([0, 1]), dist.new_group([2, 3])
    if rank < 2:  # the uninterrupted run, checkpointed on the way
        pipe, opt = _pipeline(first, "zbv", [2, 1, 1, 2])
        _train_pipeline(pipe, opt, range(BEFORE))
        pipetrain.save_checkpoint(path, pipe, opt)
        out["saved"] = _snapshot(pipe.modules.values())
        dist.barrier()
        _train_pipeline(pipe, opt, range(BEFORE, BEFORE + AFTER))
        out["uninterrupted"] = _snapshot(pipe.modules.values())
    else:  # the same layout, resumed
        dist.barrier()
        pipe, opt = _pipeline(second, "zbv", [2, 1, 1, 2])
        pipetrain.load_checkpoint(path, pipe, opt)
        _train_pipeline(pipe, opt, range(BEFORE, BEFORE + AFTER))
        out["same_layout"] = _snapshot(pipe.modules.values())
    # pp=4, another cut; each rank builds only its own layers, on the meta device first
    stages = pipetrain.split(
        _layer_factory,
        [1, 2, 2, 1],
        num_layers=CKPT_LAYERS,
        names=list(build_layers(CKPT_LAYERS, tie=False)),
        init=lambda index, layer: [p.zero_() for p in layer.parameters()],
    )
    pipe = pipetrain.Pipeline(stages, "1f1b", CKPT_MB, TokenCrossEntropy(IGNORE))
    opt = _adamw(pipe.parameters())
    pipetrain.load_checkpoint(path, pipe, opt)
    _train_pipeline(pipe, opt, range(BEFORE, BEFORE + AFTER))
    out["pp4"] = _snapshot(pipe.modules.values())
    if rank == 0:  # the plain model: micro-batches accumulated by hand, in the same order
        (model,) = pipetrain.split(build_layers(CKPT_LAYERS, tie=False, seed=99), [CKPT_LAYERS])
        opt = _adamw(model.parameters())
        pipetrain.load_checkpoint(path, model, opt)
        loss_fn = TokenCrossEntropy(IGNORE)
        for step in range(BEFORE, BEFORE + AFTER):
            opt.zero_grad()
            tokens, targets, mask = batch(9, seed=100 + step)
            count = (targets != IGNORE).sum().item()
            for x, y, mk in zip(*(torch.tensor_split(t, CKPT_MB) for t in (tokens, targets, mask))):
                (loss_fn(model(x, attention_mask=mk), y) * (1.0 / count)).backward()
            opt.step()
        out["pp1"] = _snapshot([model])
        out["errors"] = _checkpoint_errors(path)
    return out


def _checkpoint_errors(path: str) -> dict[str, str]:
    import pipetrain

    (bigger,) = pipetrain.split(build_layers(CKPT_LAYERS + 1, tie=False), [CKPT_LAYERS + 1])
    (model,) = pipetrain.split(build_layers(CKPT_LAYERS, tie=False), [CKPT_LAYERS])
    other = nn.Sequential(nn.Linear(2, 2))
    return {
        "missing_layer": _error_of(lambda: pipetrain.load_checkpoint(path, bigger)),
        "other_model": _error_of(lambda: pipetrain.load_checkpoint(path, other)),
        "state_dict": _error_of(lambda: _load_partial(model, bigger)),
    }


def _load_partial(model, bigger) -> None:
    from pipetrain.runtime.checkpoint import load_model_state

    load_model_state([bigger], model.state_dict())
