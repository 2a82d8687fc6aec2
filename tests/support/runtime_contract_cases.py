"""Per-rank runners for the contract tests: ranks that disagree are refused together, a rank that
fails stops its peers within seconds naming it (run inside spawned processes)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed
from torch import nn

TIMEOUT = timedelta(seconds=20)  # far above every bound asserted: a hang shows as a timeout


class Boom(nn.Module):
    """A linear stage that raises at micro-batch ``at`` of its first step."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4).double()
        self.calls = 0
        self.at = at

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at + 1:
            raise RuntimeError("user code failed here")
        return self.lin(x)


def stages(n: int, width: int = 4, narrow: int | None = None) -> list[nn.Module]:
    """``n`` linear stages; ``narrow``: that stage takes 8 features (a shape mismatch)."""
    torch.manual_seed(0)
    out = []
    for s in range(n):
        out.append(nn.Linear(8 if s == narrow else width, width).double())
    return out


def data(size: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 4, generator=g, dtype=torch.float64)
    return x, torch.randn(size, 4, generator=g, dtype=torch.float64)


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def _outcome(fn) -> tuple[str, float]:
    start = time.monotonic()
    try:
        fn()
        result = "no error"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    return result, time.monotonic() - start


def run_contract(rank: int, world: int) -> dict:
    """Every case on this launch; per case (error text, seconds it took on this rank)."""
    import pipetrain

    last = world - 1

    def build(n_stages=world, schedule="1f1b", m=4, modules=None, **kw):
        return pipetrain.Pipeline(
            modules if modules is not None else stages(n_stages),
            schedule,
            m,
            loss_fn,
            timeout=TIMEOUT,
            **kw,
        )

    # Ranks start seconds apart on a loaded machine: build once (imports, first groups) and meet,
    # so each case's seconds measure the refusal, not a peer's late start.
    build().close()
    torch.distributed.barrier()
    out = {}
    out["microbatches"] = _outcome(lambda: build(m=5 if rank == last else 4))
    out["schedule"] = _outcome(lambda: build(schedule="gpipe" if rank == last else "1f1b"))
    out["stage_count"] = _outcome(
        lambda: build(
            n_stages=2 * world if rank == last else world,
            schedule="interleaved-1f1b",
            stages_per_rank=2 if rank == last else 1,
        )
    )
    bad = stages(world)
    if rank == last:
        bad[last] = "not a module"  # type: ignore[call-overload]
    out["construction_fails"] = _outcome(lambda: build(modules=bad))
    # before the pipeline has its process groups, and in a cut made inside ``from_plan``
    missing = None if rank == last else loss_fn
    out["no_loss_fn"] = _outcome(
        lambda: pipetrain.Pipeline(stages(world), "1f1b", 4, missing, timeout=TIMEOUT)
    )
    layers = [nn.Linear(4, 4).double() for _ in range(world + (rank == last))]
    plan = {"schedule": "1f1b", "ranks": world, "stages_per_rank": 1, "microbatches": 4}
    plan["stage_layers"] = [1] * world
    out["plan_cut_fails"] = _outcome(
        lambda: pipetrain.Pipeline.from_plan(layers, plan, loss_fn, timeout=TIMEOUT)
    )

    pipe = build()
    x, y = data()
    out["ok_step"] = _outcome(lambda: pipe.step(x, y))
    xs, ys = data(size=10 if rank == last else 8)
    out["input_shape"] = _outcome(lambda: pipe.step(xs, ys))

    pipe = build()
    xv, yv = data(seed=1 if rank == 0 else 0)
    out["input_values"] = _outcome(lambda: pipe.step(xv, yv))

    boom = stages(world)
    boom[1] = Boom(at=2)
    pipe = build(modules=boom)
    out["stage_raises"] = _outcome(lambda: pipe.step(x, y))
    out["after_failure"] = _outcome(lambda: pipe.step(x, y))

    pipe = build(modules=stages(world, narrow=1))
    out["shape_mismatch"] = _outcome(lambda: pipe.step(x, y))

    pipe = build()
    out["loss_mismatch"] = _outcome(lambda: pipe.step(x, y[:, :3]))

    with build() as healthy:  # still works after all that, on the same default group
        out["healthy"] = _outcome(lambda: healthy.step(x, y))
    return out
