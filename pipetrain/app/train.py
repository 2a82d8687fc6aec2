"""``pipetrain train``'s training loop: one worker's steps, inside an initialised process group of
ranks × dp processes (``app.launch`` starts them).

A worker builds its own stages (same seed everywhere, so the weights equal the unsplit model's)
and runs them with ``Pipeline.from_plan`` on the run's layout (``app.layout``). Tokens are the
bytes of a text file (``--text``; by default the corpus ``app.models.data`` generates, written to
``--corpus-out`` first). It trains with AdamW (``--clip-grad-norm``: clipped by the whole
pipeline's norm), writes checkpoints every ``--checkpoint-every`` steps (``app.checkpoints``;
``--resume`` continues from the latest one, bit for bit on the same layout), and on rank 0 shows
a progress bar (loss, tokens/s). The last ``MEASURED_STEPS`` steps are measured
(``timeline=True``) for the end-of-run report (``app.report``). What the pipeline refuses at
construction is raised as ``Refused``, the same on every rank.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetrain.app.layout import check_arguments
from pipetrain.app.options import model_shape
from pipetrain.app.report import Progress, report
from pipetrain.schedule.timeline import Timeline

if TYPE_CHECKING:
    import torch

MEASURED_STEPS = 5  # the last steps run with timeline=True; the median one is reported
#: ``--weight-grads`` → ``Pipeline(defer_weight_grads=...)``
_DEFER = {"auto": None, "deferred": True, "replay": False}


class Refused(ValueError):
    """The pipeline refused the configuration at construction (the same on every rank)."""


@dataclass
class Run:
    """What a worker's training loop gives back."""

    losses: list[float]
    #: the step each loss belongs to (from the first step run, after a resume)
    first_step: int
    state: dict[str, Any] = field(default_factory=dict)
    report: str = ""


def read_tokens(args: argparse.Namespace) -> torch.Tensor:
    """The text file's bytes as token ids (the generated corpus, written first, by default)."""
    import torch

    path = Path(args.text) if args.text is not None else Path(args.corpus_out)
    if args.text is None and not path.is_file():
        from pipetrain.app.models.data import make_corpus

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several ranks may write at once
        tmp.write_bytes(make_corpus())
        tmp.replace(path)
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def train(args: argparse.Namespace, device: torch.device) -> Run:
    """One worker's training loop, inside an initialised process group of ranks × dp."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pipetrain.app import checkpoints
    from pipetrain.app.catalog import build
    from pipetrain.app.models.data import batches
    from pipetrain.runtime.pipeline import Pipeline

    layout = check_arguments(args)
    rank = dist.get_rank()
    model = build(model_shape(args))
    placement: dict[str, Any] = {}
    replica = 0
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.dp, layout.ranks), mesh_dim_names=("dp", "pp"))
        placement = {"mesh": mesh, "data_parallel": args.data_parallel}
        replica = mesh.get_local_rank("dp")
    try:
        pipe = Pipeline.from_plan(
            model.layers,
            layout,
            loss_fn=model.loss_fn,
            device=device,
            timeout=timedelta(seconds=args.timeout),
            defer_weight_grads=_DEFER[args.weight_grads],
            receive_lead=args.receive_lead,
            tied=model.tied,
            **placement,
        )
    except ValueError as e:
        flags = f"--tie-embeddings with --dp {args.dp}: " if model.tied and args.dp > 1 else ""
        raise Refused(flags + str(e)) from None
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95))
    saver = (
        checkpoints.Checkpoints(args.checkpoint_dir, model.shape) if args.checkpoint_dir else None
    )
    try:
        start = saver.resume(pipe, opt) if saver is not None and args.resume else 0
    except ValueError as e:
        raise Refused(str(e)) from None
    if start >= args.steps:
        raise Refused(
            f"the checkpoint in {args.checkpoint_dir} is at step {start}; --steps {args.steps} "
            "leaves nothing to run (give more steps)"
        )
    local = args.microbatch_size * layout.microbatches
    data = batches(read_tokens(args), local * args.dp, args.seq_len, args.seed)
    for _ in range(start):  # the batches the checkpointed steps used
        next(data)
    mine = slice(replica * local, (replica + 1) * local)
    every = args.checkpoint_every or args.steps
    bar = Progress(args.steps, enabled=rank == 0, start=start)
    losses: list[float] = []
    measured: list[Timeline] = []
    for step in range(start, args.steps):
        inputs, targets = (t[mine].to(device) for t in next(data))
        timed = step >= args.steps - MEASURED_STEPS
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(*model.batch(inputs, targets), timeline=timed)
        norm = pipe.clip_grad_norm_(args.clip_grad_norm) if args.clip_grad_norm else None
        opt.step()
        losses.append(float(loss))
        rate = inputs.numel() * args.dp / (time.perf_counter() - t0)
        bar.update(step + 1, losses[-1], rate, None if norm is None else float(norm))
        if timed and pipe.last_timeline is not None:
            measured.append(pipe.last_timeline)
        if saver is not None and ((step + 1) % every == 0 or step + 1 == args.steps):
            saver.save(step + 1, pipe, opt)
    bar.close()
    run = Run(losses, start, {k: v.detach().clone() for k, v in _local_state(pipe).items()})
    if rank == 0:
        run.report = report(args, losses, measured, pipe.program, shared_cores=device.type == "cpu")
        if saver is not None:
            run.report += f"\ncheckpoints in {args.checkpoint_dir} (latest: step {args.steps})"
    return run


def _local_state(pipe) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by global name."""
    out = {}
    for s in sorted(pipe.modules):
        out.update(pipe.modules[s].state_dict())
    return out


__all__ = ["MEASURED_STEPS", "Refused", "Run", "read_tokens", "train"]
