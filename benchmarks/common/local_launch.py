"""Run a benchmark's per-rank entry under torchrun, or without it by spawning its processes here
(a CPU dry run on gloo needs no launcher)."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable

Start = Callable[[argparse.Namespace, int, int], int | None]


def launch(args: argparse.Namespace, start: Start) -> int:
    """``start(args, rank, world)`` on this rank under torchrun; otherwise ``args.nproc``
    processes spawned on a free local port, each running it. A truthy return is a failure."""
    if "RANK" in os.environ:
        return int(start(args, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) or 0)
    import torch.multiprocessing as mp

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(_worker, args=(args, start), nprocs=args.nproc, join=True)
    return 0


def _worker(rank: int, args: argparse.Namespace, start: Start) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(args.nproc), LOCAL_RANK=str(rank))
    if start(args, rank, args.nproc):
        raise SystemExit(1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
