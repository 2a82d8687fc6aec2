"""``pipetrain train``'s training loop: one worker's steps, inside an initialised process group of
ranks × dp processes (``app.launch`` starts them).

A worker builds its own stages (same seed everywhere, so the weights equal the unsplit model's)
and runs them with ``Pipeline.from_plan`` on the run's layout (``app.config``); with
``--model-dir`` it loads its stages from the folder and trains on the folder tokenizer's padded
rows instead (``app.model_folder``), and ``--export`` writes the folder back at the end. Tokens
are the bytes of a text file (``--text``; by default the corpus ``app.models.data`` generates, written to
``--corpus-out`` first). It trains with AdamW (``--clip-grad-norm``: clipped by the whole
pipeline's norm), writes checkpoints every ``--checkpoint-every`` steps (``app.checkpoints``;
``--resume`` continues from the latest one, bit for bit on the same layout), and on rank 0 shows
a progress bar (loss, tokens/s). The last ``MEASURED_STEPS`` steps are measured
(``timeline=True``) for the end-of-run report (``app.report``). What the pipeline refuses at
construction is raised as ``Refused``, the same on every rank; a loss that is not finite raises
``NonFinite`` before that step's update (``--on-nonfinite skip``: the update is skipped), the same
on every rank too, since every rank returns the same loss.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetrain.app.config import TrainConfig, check_arguments, run_shape
from pipetrain.app.report import Progress, report
from pipetrain.schedule.timeline import Timeline

if TYPE_CHECKING:
    import torch

    from pipetrain.app.catalog import LayerModel
    from pipetrain.planner.layout import Layout
    from pipetrain.runtime.pipeline import Pipeline

#: one step's batch: stage 0's inputs, the loss's targets, side inputs by name
Batch = tuple["torch.Tensor", "torch.Tensor", dict[str, "torch.Tensor"]]
MEASURED_STEPS = 5  # the last steps run with timeline=True; the median one is reported
#: ``--weight-grads`` → ``Pipeline(defer_weight_grads=...)``
_DEFER = {"auto": None, "deferred": True, "replay": False}


class Refused(ValueError):
    """The pipeline refused the configuration at construction (the same on every rank)."""


class NonFinite(ArithmeticError):
    """The loss was nan or inf and ``--on-nonfinite stop`` (the same on every rank: every rank
    returns the same loss)."""


@dataclass
class Run:
    """What a worker's training loop gives back."""

    losses: list[float]
    #: the step each loss belongs to (from the first step run, after a resume)
    first_step: int
    state: dict[str, Any] = field(default_factory=dict)
    report: str = ""


def text_path(config: TrainConfig) -> Path:
    """The text to train on: ``--text``, else the generated corpus (written first if missing)."""
    path = Path(config.text) if config.text is not None else Path(config.corpus_out)
    if config.text is None and not path.is_file():
        from pipetrain.app.models.data import make_corpus

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several ranks may write at once
        tmp.write_bytes(make_corpus())
        tmp.replace(path)
    return path


def read_tokens(config: TrainConfig) -> torch.Tensor:
    """The text file's bytes as token ids (the generated corpus, written first, by default)."""
    import torch

    path = text_path(config)
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def _batches(config: TrainConfig, model: LayerModel | None, rows: int) -> Iterator[Batch]:
    """Endless ``(inputs, targets, side inputs)`` of ``rows`` rows (every replica's): windows of
    the text's bytes for the built-in models, padded rows of the folder's tokens for
    ``--model-dir`` (``app.model_folder``)."""
    if model is None:
        from pipetrain.app.model_folder import padded_batches

        yield from padded_batches(config, rows)
        return
    from pipetrain.app.models.data import batches

    for inputs, targets in batches(read_tokens(config), rows, config.seq_len, config.seed):
        yield (*model.batch(inputs, targets), {})


def train(config: TrainConfig, device: torch.device) -> Run:
    """One worker's training loop, inside an initialised process group of ranks × dp."""
    import torch
    import torch.distributed as dist

    from pipetrain.app import checkpoints
    from pipetrain.app.catalog import build

    layout = check_arguments(config)
    rank = dist.get_rank()
    model = build(config.shape) if config.model_dir is None else None  # None: the folder's
    pipe, replica = _pipeline(config, layout, model, device)
    # closed at the end: a captured step (--cuda-graph) holds NCCL's communicators until its
    # pipeline lets go, and the worker destroys its process group next
    with pipe:
        opt = torch.optim.AdamW(_parameter_groups(pipe), lr=config.lr, betas=(0.9, 0.95))
        saver = (
            checkpoints.Checkpoints(
                config.checkpoint_dir, run_shape(config), overwrite=config.overwrite_checkpoints
            )
            if config.checkpoint_dir
            else None
        )
        try:
            start = saver.resume(pipe, opt) if saver is not None and config.resume else 0
        except ValueError as e:
            raise Refused(str(e)) from None
        pipe.dropout_keys.step = start  # a resumed run draws the straight run's masks
        if start >= config.steps:
            raise Refused(
                f"the checkpoint in {config.checkpoint_dir} is at step {start}; --steps {config.steps} "
                "leaves nothing to run (give more steps)"
            )
        local = config.microbatch_size * layout.microbatches
        data = _batches(config, model, local * config.dp)
        for _ in range(start):  # the batches the checkpointed steps used
            next(data)
        mine = slice(replica * local, (replica + 1) * local)
        every = config.checkpoint_every or config.steps
        bar = Progress(config.steps, enabled=rank == 0, start=start)
        losses: list[float] = []
        measured: list[Timeline] = []
        skipped: list[int] = []
        for step in range(start, config.steps):
            inputs, targets, side = next(data)
            inputs, targets = inputs[mine].to(device), targets[mine].to(device)
            side = {k: v[mine].to(device) for k, v in side.items()}
            # a captured step replays as one: no per-action timeline to measure
            timed = not config.cuda_graph and step >= config.steps - MEASURED_STEPS
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = pipe.step(inputs, targets, timeline=timed, side=side)
            try:
                norm = _update(config, pipe, opt, loss, step + 1, skipped)
            except NonFinite:
                bar.close()
                raise
            losses.append(float(loss))
            mask = side.get("attention_mask")  # padded rows: count the real tokens only
            tokens = inputs.numel() if mask is None else int(mask.sum())
            rate = tokens * config.dp / (time.perf_counter() - t0)
            bar.update(step + 1, losses[-1], rate, None if norm is None else float(norm))
            if timed and pipe.last_timeline is not None:
                measured.append(pipe.last_timeline)
            if saver is not None and ((step + 1) % every == 0 or step + 1 == config.steps):
                saver.save(step + 1, pipe, opt)
        bar.close()
        if config.export is not None:
            from pipetrain.app.model_folder import export

            export(config, pipe)
        run = Run(losses, start, {k: v.detach().clone() for k, v in _local_state(pipe).items()})
        if rank == 0:
            cpu_processes = dist.get_world_size() if device.type == "cpu" else 0
            run.report = _report(config, losses, measured, pipe, cpu_processes, skipped)
        return run


def _report(
    config: TrainConfig,
    losses: list[float],
    measured: list[Timeline],
    pipe: Pipeline,
    cpu_processes: int,
    skipped: list[int],
) -> str:
    """The end-of-run text (``app.report``) and what the run skipped, wrote and exported."""
    args = (config.svg, losses, measured, pipe.program, cpu_processes, _planned(config.plan))
    if config.cuda_graph:
        text = report(*args, unmeasured="each step replayed as one CUDA graph", trace=config.trace)
    else:
        text = report(*args, trace=config.trace)
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (" ..." if len(skipped) > 10 else "")
        text += f"\nskipped the update of {len(skipped)} step(s) whose loss was not "
        text += f"finite (--on-nonfinite skip): {shown}"
    if config.checkpoint_dir:
        text += f"\ncheckpoints in {config.checkpoint_dir} (latest: step {config.steps})"
    if config.export is not None:
        text += f"\nexported to {config.export} (a Hugging Face model folder)"
    return text


def _update(config: TrainConfig, pipe, opt, loss, step: int, skipped: list[int]):
    """The optimizer's update after ``step``'s backward (clipped first with
    ``--clip-grad-norm``; its norm returned), unless the loss is not finite: then the step is
    added to ``skipped`` (``--on-nonfinite skip``) or ``NonFinite`` raised. Every rank holds the
    same loss, so every rank decides alike with no collective."""
    if not pipe.loss_is_finite(loss):
        if config.on_nonfinite == "skip":
            skipped.append(step)
            opt.zero_grad(set_to_none=True)
            return None
        raise NonFinite(
            f"the loss is {float(loss)} at step {step}: stopped before its optimizer step (lower "
            f"--lr {config.lr:g}, or clip with --clip-grad-norm; --on-nonfinite skip skips such "
            "steps instead)"
        )
    norm = pipe.clip_grad_norm_(config.clip_grad_norm) if config.clip_grad_norm else None
    opt.step()
    return norm


def _pipeline(
    config: TrainConfig, layout: Layout, model: LayerModel | None, device: torch.device
) -> tuple[Pipeline, int]:
    """This worker's pipeline on the layout (on a (dp, pp, tp) mesh when ``--dp`` or ``--tp`` >
    1, the layers tensor-parallelized by the Llama family's plan), and its data-parallel
    replica; ``Refused`` with the pipeline's message when it refuses. ``model`` None: the
    ``--model-dir`` folder's stages (``app.model_folder``)."""
    from datetime import timedelta

    from pipetrain.app import kernels
    from pipetrain.runtime.pipeline import Pipeline

    placement, replica = _placement(config, layout, device)
    tp_mesh = placement["mesh"]["tp"] if config.tp > 1 else None
    options: dict[str, Any] = dict(
        device=device,
        timeout=timedelta(seconds=config.timeout),
        defer_weight_grads=_DEFER[config.weight_grads],
        receive_lead=config.receive_lead,
        cuda_graph=config.cuda_graph,
        # every rank compiles at once where the runtime finds it exact (runtime.precompile)
        precompile=None if config.compile else False,
        seed=config.seed,  # dropout keyed by (seed, step, micro-batch, layer): any layout draws alike
        **placement,
    )
    try:
        if model is None:
            from pipetrain.app.model_folder import folder_stages
            from pipetrain.hf import causal_lm_token_loss

            stages, tied = folder_stages(config, layout, tp_mesh, device)
            pipe = Pipeline(
                stages,
                layout.schedule,
                layout.microbatches,
                causal_lm_token_loss,
                stages_per_rank=layout.stages_per_rank,
                num_stages=len(layout.stage_layers),
                offload=layout.offload_spec,  # from_plan's own, for the folder's stages
                **options,
            )
            return pipe, replica
        tied = bool(model.tied)
        if tp_mesh is not None:
            from pipetrain.hf import parallelize_causal_lm

            assert isinstance(model.layers, Mapping)  # Hugging Face models (checked at launch)
            parallelize_causal_lm(
                model.layers,
                tp_mesh,
                sequence_parallel=config.sequence_parallel,
                vocab_parallel=not tied,
            )
        layers = kernels.prepared(model.layers, model.names, config, device)
        pipe = Pipeline.from_plan(layers, layout, loss_fn=model.loss_fn, tied=model.tied, **options)
    except ValueError as e:
        what = "--tie-embeddings" if model is not None else "the folder's tied embeddings"
        flags = f"{what} with --dp {config.dp}: " if tied and config.dp > 1 else ""
        raise Refused(flags + str(e)) from None
    return pipe, replica


def _placement(
    config: TrainConfig, layout: Layout, device: torch.device
) -> tuple[dict[str, Any], int]:
    """``Pipeline``'s placement options (a (dp, pp, tp) mesh when ``--dp`` or ``--tp`` > 1,
    dp-major and tp innermost: the tp ranks of a stage on one node's consecutive GPUs) and this
    process's data-parallel replica."""
    if config.dp == 1 and config.tp == 1:
        return {}, 0
    from torch.distributed.device_mesh import init_device_mesh

    dims = [(n, size) for n, size in (("dp", config.dp), ("pp", layout.ranks), ("tp", config.tp))]
    dims = [(n, size) for n, size in dims if size > 1 or n == "pp"]
    mesh = init_device_mesh(
        device.type, tuple(size for _, size in dims), mesh_dim_names=tuple(n for n, _ in dims)
    )
    placement: dict[str, Any] = {"mesh": mesh}
    if config.dp == 1:
        return placement, 0
    placement["data_parallel"] = config.data_parallel
    return placement, mesh.get_local_rank("dp")


def _parameter_groups(pipe: Pipeline) -> list[dict[str, Any]]:
    """This rank's parameters in two groups, DTensors (tensor parallel, FSDP2) and plain ones:
    AdamW's fused multi-tensor step refuses a list that mixes them (on CUDA, its default)."""
    from torch.distributed.tensor import DTensor

    params = list(pipe.parameters())
    kinds = [
        [p for p in params if isinstance(p, DTensor)],
        [p for p in params if not isinstance(p, DTensor)],
    ]
    return [{"params": group} for group in kinds if group]


def _planned(plan_file: str | None) -> dict[str, Any] | None:
    """The ``predicted`` record of ``--plan FILE`` (checked before launch), if it has one."""
    if plan_file is None:
        return None
    import json

    predicted = json.loads(Path(plan_file).read_text()).get("predicted")
    return predicted if isinstance(predicted, dict) else None


def _local_state(pipe) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by global name."""
    out = {}
    for s in sorted(pipe.modules):
        out.update(pipe.modules[s].state_dict())
    return out


__all__ = ["MEASURED_STEPS", "NonFinite", "Refused", "Run", "read_tokens", "train"]
