"""DeepSpeed's pipeline engines in ``incumbents.py``.

* ``deepspeed``: ``PipelineModule`` of one ``LayerSpec`` per stage (``partition_method=
  'uniform'``, so stage ``s`` is exactly everyone's stage ``s``) and ``engine.train_batch`` (its
  1F1B ``TrainSchedule``, the optimizer step inside), the client optimizer the same AdamW on the
  bf16 parameters as everyone's, ZeRO stage 0. Its ``bf16`` switch is off: it would swap in
  DeepSpeed's ``BF16_Optimizer``, a different optimizer step from everyone else's.
* ``deepspeed-bf16``: the same with ``bf16: {enabled: true}``, DeepSpeed's realistic set-up: the
  ``BF16_Optimizer`` keeps float32 master weights and accumulates gradients in float32 (more
  memory and a float32 AdamW; not the same optimizer step, so a row beside the others).
* ``deepspeed-dualpipev``: DeepSpeed's DualPipeV (``DualPipeVModule`` of one ``LayerSpec`` per
  stage of the V, ``DualPipeVEngine``: rank ``r`` holds stages ``r`` and ``2P-1-r``, the loss on
  rank 0); DeepSpeed's version keeps weight gradients inside the backward (no zero-bubble split).
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from torch import nn

from benchmarks.common.gpu_setup import Ctx, make_optimizer
from benchmarks.incumbents.incumbents_runners import profiled
from benchmarks.incumbents.incumbents_shapes import Row, UnitBank
from benchmarks.pipeline.gpu_pipeline import measure


class DeepSpeedStage(nn.Module):
    """A ``LayerSpec`` target: stage ``s`` of the row's cut, built from the shared units."""

    def __init__(self, build, s: int) -> None:
        super().__init__()
        self.inner = build(s)

    def forward(self, x):
        return self.inner(x)


def run_deepspeed(ctx: Ctx, bank: UnitBank, row: Row) -> dict:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    dualpipev = row.lib == "deepspeed-dualpipev"
    base = ctx.mem_reset()
    build = functools.partial(bank.stage, row.shape, row.cut)
    specs = [LayerSpec(DeepSpeedStage, build, s) for s in range(row.num_stages)]
    common = dict(num_stages=ctx.world, loss_fn=row.shape.loss, partition_method="uniform")
    if dualpipev:
        from deepspeed.pipe import DualPipeVModule

        module: nn.Module = DualPipeVModule(layers=specs, **common)
    else:
        module = PipelineModule(layers=specs, activation_checkpoint_interval=0, **common)
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(ctx, params)
    config: dict = {
        "train_batch_size": row.shape.mb_size * row.n,
        "train_micro_batch_size_per_gpu": row.shape.mb_size,
        "gradient_accumulation_steps": row.n,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0},
    }
    if row.lib == "deepspeed-bf16":
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
    x, y = row.shape.batch(ctx.device, ctx.dtype, row.n)
    if row.lib == "deepspeed-bf16" and x.is_floating_point():  # a float32 CPU smoke
        x, y = x.bfloat16(), y.bfloat16()
    pairs = list(zip(x.chunk(row.n), y.chunk(row.n)))

    # train_batch steps the optimizer itself: nothing more to step after it (opt None)
    def step() -> None:
        engine.train_batch(data_iter=iter(pairs))

    out, _ = measure(ctx, step, None, [], base)
    out.update(profiled(ctx, row, step, None, []))
    out["stage_layers"] = ctx.gather(list(module.parts))[0]
    return out
