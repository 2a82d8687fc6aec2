"""A barrier that names this process's device on NCCL.

``dist.barrier`` on an NCCL group runs an all-reduce on a device it has to guess when the process
group was initialised without ``device_id`` (as torchrun scripts and ``pipetrain train`` do: an
eagerly initialised communicator would carry the pipeline's sends and receives too, serialised),
and it warns on every run that it guessed. The device it would guess is the current one, which
every rank sets before it builds a pipeline; naming it changes nothing but the warning.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """``dist.barrier(group)``, with the current CUDA device named where ``group`` is NCCL's."""
    if dist.get_backend(group) == "nccl":
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier(group=group)
