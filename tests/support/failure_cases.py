"""Per-rank runner for ``tests/runtime/test_failure_before_pipeline.py``: rank 1 fails before or
while building a pipeline that rank 0 builds; what each rank raised and how long it took."""

from __future__ import annotations

import errno
import time
from datetime import timedelta


def fail_around_construction(rank: int, world: int) -> list[tuple[str, str, float]]:
    """Three pipelines in a row (the ranks' n-th pipelines meet): rank 1 fails before building
    the first (an ``OSError``) and the second (a ``ValueError``) and tells its peers; it fails
    inside the third's construction (its stage factory raises). Rank 0 waits with a 60 s
    timeout each time."""
    import torch
    from torch import nn

    import pipetrain
    from pipetrain.runtime.comm.agreement import fail_next_pipeline

    torch.manual_seed(0)
    layers = [nn.Linear(4, 4) for _ in range(4)]
    errors = {
        "before, OSError": OSError(errno.ENOSPC, "No space left on device", "/data/shard-1"),
        "before, ValueError": ValueError("shard 1 holds no layer 3"),
    }
    seen = []
    for case in (*errors, "inside"):
        t0 = time.monotonic()
        try:
            if rank == 1 and case in errors:
                try:
                    raise errors[case]
                except Exception as e:
                    fail_next_pipeline(e)
                    raise

            def stage(index: int, case: str = case) -> nn.Module:
                if rank == 1 and case == "inside":
                    raise RuntimeError("stage 1 could not be loaded")
                return nn.Sequential(*layers[2 * index : 2 * index + 2])

            pipetrain.Pipeline(
                stage,
                "1f1b",
                2,
                nn.functional.mse_loss,
                num_stages=2,
                timeout=timedelta(seconds=60),
            ).close()
            seen.append((case, "built", time.monotonic() - t0))
        except Exception as e:
            seen.append((case, f"{type(e).__name__}: {e}", time.monotonic() - t0))
    return seen
