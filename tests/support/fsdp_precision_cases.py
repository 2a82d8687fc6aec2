"""Per-rank runner for FSDP2 in the precisions people train in (``tests/runtime/
test_fsdp_precisions.py``): on a ``("dp", "pp")`` mesh of 2 × 2 over gloo, every loss reduction
in float32 and bfloat16, FSDP2 against DDP from the same weights on the same batch. FSDP2 picks
reductions gloo lacks (AVG, PREMUL_SUM) outside float64; the pipeline makes it sum."""

from __future__ import annotations

import torch
from dp_cases import LOSSES, build_stages, class_targets
from torch.distributed.device_mesh import init_device_mesh

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def _grads(pipe) -> dict[str, torch.Tensor]:
    out = {}
    for module in pipe.modules.values():
        for name, p in module.named_parameters():
            if p.grad is not None:
                g = p.grad
                out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).double()
    return out


def run_fsdp_precisions(rank: int, world: int) -> dict:
    """Per (dtype, reduction): FSDP2's loss and largest gradient difference from DDP's."""
    import pipetrain

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)
    rows = slice(8 * replica, 8 * replica + 8)
    out = {}
    for dtype_name, tol in TOLERANCE.items():
        dtype = getattr(torch, dtype_name)
        for loss, reduction, _ in LOSSES.values():
            targets = class_targets(y) if reduction == "token_mean" else y.to(dtype)
            runs = {}
            for kind in ("ddp", "fsdp"):
                stages = [s.to(dtype) for s in build_stages(2)]
                pipe = pipetrain.Pipeline(
                    stages, "1f1b", 4, loss, mesh=mesh, data_parallel=kind, loss_reduction=reduction
                )
                value = pipe.step(x[rows].to(dtype), targets[rows])
                runs[kind] = (float(value), _grads(pipe))
                pipe.close()
            (ddp_loss, ddp), (fsdp_loss, fsdp) = runs["ddp"], runs["fsdp"]
            worst = max((fsdp[k] - ddp[k]).abs().max().item() for k in ddp)
            out[(dtype_name, reduction)] = (
                fsdp_loss,
                ddp_loss,
                worst,
                tol,
                sorted(ddp) == sorted(fsdp),
            )
    return out
