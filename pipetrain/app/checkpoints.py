"""``pipetrain train``'s checkpoint directory: one DCP checkpoint per saved step, and a pointer to
the latest.

    DIR/step-000040/       model and optimizer state by global name (pipetrain.save_checkpoint)
    DIR/step-000040/train.json   the step and the model's shape
    DIR/latest             "step-000040", written once the whole checkpoint is on disk

State is keyed by the model's global layer names (``runtime.checkpoint``), so a run may resume
at another pipeline size or schedule, and with or without data parallel (DDP or FSDP2, whose
replicas write their shards). Resuming checks the model's shape first and names the
first field that differs. The step count is all the training loop needs besides: the data
order is a function of the seed and the step, and AdamW's state (its step included) is in the
checkpoint — so a run resumed on the same layout continues bit for bit. On another layout it
continues to float64 round-off only: the layout decides which stages accumulate a linear's weight
gradient inside the GEMM and which add it after, and a BLAS may round the two differently
(docs/training.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from pipetrain.app.catalog import ModelShape

LATEST = "latest"
INFO = "train.json"
#: fields of the shape a checkpoint must share with the run resuming it (the seed only orders
#: the data and initialises weights the checkpoint replaces)
_MUST_MATCH = tuple(f.name for f in dataclasses.fields(ModelShape) if f.name != "seed")


class Checkpoints:
    """Save and resume under one directory (every process of the run calls both)."""

    def __init__(self, directory: str | os.PathLike, shape: ModelShape) -> None:
        self.directory = Path(directory)
        self.shape = shape

    def save(self, step: int, pipe, optimizer) -> Path:
        """Write step ``step``: every process writes its part (with data parallel, each DDP
        replica offers the same tensors and DCP writes them once; each FSDP2 replica its shards).
        """
        import torch.distributed as dist

        from pipetrain.runtime.checkpoint import save_checkpoint

        path = self.directory / f"step-{step:06d}"
        save_checkpoint(path, pipe, optimizer)
        dist.barrier()  # every writer is done before the pointer moves
        if dist.get_rank() == 0:
            info = {"step": step, "model": dataclasses.asdict(self.shape)}
            (path / INFO).write_text(json.dumps(info, indent=1) + "\n")
            tmp = self.directory / f"{LATEST}.tmp"
            tmp.write_text(path.name + "\n")
            tmp.replace(self.directory / LATEST)
        dist.barrier()
        return path

    def latest(self) -> tuple[Path, int]:
        """The latest checkpoint's directory and step; ``ValueError`` when there is none or it
        is of another model."""
        pointer = self.directory / LATEST
        if not pointer.is_file():
            raise ValueError(
                f"no checkpoint to resume from in {self.directory} (no {LATEST!r} file); "
                "run without --resume first, with --checkpoint-dir"
            )
        path = self.directory / pointer.read_text().strip()
        try:
            info = json.loads((path / INFO).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"checkpoint {path} is incomplete ({e})") from None
        saved = info.get("model", {})
        for name in _MUST_MATCH:
            if saved.get(name) != getattr(self.shape, name):
                flag = "--" + {"blocks": "layers"}.get(name, name).replace("_", "-")
                raise ValueError(
                    f"checkpoint {path} is of another model: {flag} {saved.get(name)} there, "
                    f"{getattr(self.shape, name)} here; resume with the same model flags"
                )
        return path, int(info["step"])

    def resume(self, pipe, optimizer) -> int:
        """Load the latest checkpoint into ``pipe`` and ``optimizer``; the step it was saved at."""
        from pipetrain.runtime.checkpoint import load_checkpoint

        path, step = self.latest()
        try:
            load_checkpoint(path, pipe, optimizer)
        except KeyError as e:
            raise ValueError(str(e.args[0]) if e.args else str(e)) from None
        return step
