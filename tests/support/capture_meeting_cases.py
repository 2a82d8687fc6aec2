"""``Agreement.captured`` across real processes (gloo): the meeting after a CUDA-graph capture
waits for the peers that capture the same step, not for peers that run it eagerly or replay, and
ends with a peer's failure notice at once."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain.runtime.comm.agreement import Agreement, pipeline_prefix
from pipetrain.runtime.comm.failures import Failures


def _agreement(rank: int, world: int) -> Agreement:
    group = dist.group.WORLD
    failures = Failures(group, rank, world, pipeline_prefix(group, rank))
    return Agreement(group, rank, world, timedelta(seconds=30), failures)


def meet(rank: int, world: int, peer_runs: str) -> str:
    """Rank 0 captures step 1; rank 1 runs it ``peer_runs`` ("capture", "eager", "replay", or
    "fail": capture, then fail before meeting). Returns what rank 0 saw, and how long it took."""
    agreement = _agreement(rank, world)
    x = [(torch.zeros(2, 3),)]
    agreement.graph_step = "capture" if rank == 0 or peer_runs == "fail" else peer_runs
    agreement.step("train", x, [torch.zeros(2)], 2)
    if rank == 1:
        if peer_runs == "fail":
            time.sleep(0.5)
            agreement.failures.post(1, "ValueError: the step could not be captured")
        elif peer_runs == "capture":
            time.sleep(2.0)  # rank 0 waits for this
            agreement.captured()
        dist.barrier()
        return ""
    t0 = time.monotonic()
    try:
        agreement.captured()
        seen = "met"
    except Exception as e:
        seen = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
    dist.barrier()
    return f"{seen} after {took:.1f} s"
