"""A measuring group of spawned worker processes, shared by the profilers that time a layer as
one rank of a real group sees it (``profile_tp_measured``, ``profile_ep_measured``).

``run_group`` spawns ``world`` processes (``torch.multiprocessing``'s spawn: a CUDA context is
never forked), hands each a free local port for the rendezvous, waits for all of them and kills
any left when one fails or the group outlives its timeout, turning either into one
``ValueError`` line; ``join_group`` is what each worker calls first: one GPU per rank with NCCL,
or gloo on a CPU with one thread per process (the processes share the machine's cores). Results
travel by file: the caller's worker writes them on rank 0, the parent reads them after the join.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def run_group(
    worker: Callable[..., None], job: Any, world: int, what: str, timeout_s: float
) -> None:
    """``worker(rank, job)`` on ``world`` spawned processes, until all end. ``ValueError`` (one
    line, starting with ``what``): a worker raised or exited non-zero, or the group did not end
    within ``timeout_s``; the rest are killed then. ``worker`` and ``job`` are picklable."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        worker, args=(job,), nprocs=world, join=False, start_method="spawn"
    )
    try:
        wait_for(context, what, timeout_s)
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def wait_for(context: Any, what: str, timeout_s: float) -> None:
    """Until every worker of ``context`` ends; one ``ValueError`` line for the first to fail
    or the timeout."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=0.2):
            if time.monotonic() > deadline:
                raise ValueError(f"{what}: the group did not finish within {timeout_s:g} s")
    except ProcessRaisedException as e:
        lines = [line for line in e.msg.strip().splitlines() if line.strip()]
        raise ValueError(f"{what}: rank {e.error_index} failed: {lines[-1].strip()}") from None
    except ProcessExitedException as e:
        raise ValueError(f"{what}: rank {e.error_index} exited with status {e.exit_code}") from None


def free_port() -> int:
    """A local TCP port nothing listens on now, for the group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_group(
    rank: int, world: int, device_type: str, port: int, timeout_s: float
) -> torch.device:
    """Join the default process group as ``rank`` of ``world`` (NCCL on GPU ``rank``, gloo on a
    CPU with one thread), its collectives timing out after ``timeout_s``; the rank's device."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # the processes share the machine's cores
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )
    return device


def check_gpus(device_type: str, world: int, what: str) -> None:
    """``ValueError`` where ``world`` ranks need more GPUs than are visible."""
    if device_type == "cuda" and world > torch.cuda.device_count():
        raise ValueError(f"{what} needs {world} GPUs, {torch.cuda.device_count()} visible")
