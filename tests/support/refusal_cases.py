"""Per-rank runners for ``test_refusals``: a configuration pipetrain refuses, found on one rank
(at construction, or at the first step), raised as ``PipelineRefused`` on every rank."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Reentrant(nn.Module):
    """A linear under ``torch.utils.checkpoint`` with ``use_reentrant=True`` (refused)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4).double()

    def forward(self, x):
        # the reentrant variant records a node only for an input that needs a gradient
        h = x.requires_grad_() if not x.requires_grad else x
        return checkpoint(self.linear, h, use_reentrant=True)


def _outcome(fn) -> tuple[str, bool, str]:
    """(type name, whether it is a ValueError, message) of what ``fn`` raised."""
    try:
        fn()
    except Exception as e:  # the test checks the type on every rank
        return type(e).__name__, isinstance(e, ValueError), str(e)
    return "no error", False, ""


def run_refusals(rank: int, world: int) -> dict:
    import pipetrain

    def loss(out, target):
        return ((out - target) ** 2).mean()

    gen = torch.Generator().manual_seed(0)  # the same batch on every rank
    x, y = (torch.randn(4, 4, dtype=torch.float64, generator=gen) for _ in range(2))

    def reentrant_at_first_step() -> None:
        torch.manual_seed(0)
        stages = [Reentrant(), nn.Linear(4, 4).double()]  # stage 0 (rank 0) refuses
        pipe = pipetrain.Pipeline(stages, "1f1b", 2, loss, device="cpu")
        pipe.step(x, y)

    def refused_on_the_last_rank_only() -> None:
        torch.manual_seed(0)
        stages = [nn.Linear(4, 4).double() for _ in range(world)]
        lead = 0 if rank == world - 1 else 1  # an argument only the last rank gets wrong
        pipetrain.Pipeline(stages, "1f1b", 2, loss, device="cpu", receive_lead=lead - 1 or 1)

    def cuda_graph_on_cpu() -> None:
        stages = [nn.Linear(4, 4).double() for _ in range(world)]
        pipetrain.Pipeline(stages, "1f1b", 2, loss, device="cpu", cuda_graph=True)

    return {
        "cuda_graph": _outcome(cuda_graph_on_cpu),
        "reentrant": _outcome(reentrant_at_first_step),
        "construction": _outcome(refused_on_the_last_rank_only),
    }
