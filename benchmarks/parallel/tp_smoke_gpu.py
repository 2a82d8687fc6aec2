"""Tensor parallel under the pipeline on real GPUs: a smoke test of the N-D mesh over NCCL.

    torchrun --nproc-per-node 2 benchmarks/parallel/tp_smoke_gpu.py --out $OUT/tp_smoke.json   # GPUs
    torchrun --nproc-per-node 2 benchmarks/parallel/tp_smoke_gpu.py                            # CPU, gloo

Each (pp, tp) layout of the world W, (pp=2, tp=W/2) and (pp=1, tp=W) (2 processes: (2, 1) and
(1, 2); 4: (2, 2) and (1, 4)), trains the token model of ``tests/support/tp_cases.py``
(embedding, 4 MLP blocks, head) in float32 with TF32 off: ``parallelize`` on ``mesh["tp"]`` (torch's colwise/rowwise styles, with and
without sequence parallel where tp > 1), ``pipetrain.split``, ``Pipeline(mesh=...)``, two steps
of step + ``clip_grad_norm_`` + AdamW. The reference is the same model unsplit and
unparallelized on the same device in every process. Checked: each step's loss within
``--tol`` (1e-5) of the reference's; reported also: the largest gradient difference of the first
step (``full_tensor()``) and the clipped norms. Exit status 1 when any loss is off.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "support"))
sys.path.insert(0, str(ROOT))

import tp_cases  # noqa: E402  (tests/support: the model, its plans, the batch)

import pipetrain  # noqa: E402

STEPS = 2
MAX_NORM = 0.05


def build(device: torch.device) -> dict[str, nn.Module]:
    """tp_cases' layers (seeded, the same in every process) in float32 on ``device``."""
    return {n: m.float().to(device) for n, m in tp_cases.build_layers(4).items()}


def reference(device: torch.device) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """The unsplit model: per-step losses, first-step gradients by name, clipped norms."""
    layers = build(device)
    model = nn.Sequential(*layers.values())
    names = {id(p): f"{ln}.{pn}" for ln, m in layers.items() for pn, p in m.named_parameters()}
    opt = AdamW(model.parameters())
    losses, grads, norms = [], {}, []
    for step in range(STEPS):
        x, y = (t.to(device) for t in tp_cases.batch(step))
        loss = tp_cases.mean_loss(model(x), y)
        loss.backward()
        if step == 0:
            grads = {names[id(p)]: p.grad.detach().clone() for p in model.parameters()}
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, grads, norms


class AdamW:
    """AdamW (foreach) over DTensor and plain parameters: torch's foreach kernels (the step's and
    ``zero_grad``'s) refuse a list mixing the two, so one optimizer holds each kind."""

    def __init__(self, params) -> None:
        from torch.distributed.tensor import DTensor

        params = list(params)
        kinds = [[p for p in params if isinstance(p, DTensor) == d] for d in (True, False)]
        self.opts = [torch.optim.AdamW(k, lr=0.05, foreach=True) for k in kinds if k]

    def step(self) -> None:
        for opt in self.opts:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.opts:
            opt.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def run_layout(pp: int, tp: int, case: dict, device: torch.device, want, tol: float) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    want_losses, want_grads, want_norms = want
    mesh = init_device_mesh(device.type, (pp, tp), mesh_dim_names=("pp", "tp"))
    layers = build(device)
    if tp > 1:
        tp_cases.parallelize(layers, mesh["tp"], case["sequence_parallel"])
    pipe = pipetrain.Pipeline(
        pipetrain.split(layers, case["stage_layers"]),
        case["schedule"],
        4,
        tp_cases.mean_loss,
        mesh=mesh,
        device=device,
    )
    opt = AdamW(pipe.parameters())
    row = {"pp": pp, "tp": tp, **case, "losses": [], "want_losses": want_losses, "norms": []}
    grad_diff = 0.0
    for step in range(STEPS):
        x, y = tp_cases.batch(step)
        loss = float(pipe.step(x.to(device), y.to(device)))
        row["losses"].append(loss)
        if step == 0:
            for module in pipe.modules.values():
                for name, p in module.named_parameters():
                    d = float((full(p.grad) - want_grads[name]).abs().max())
                    grad_diff = max(grad_diff, d)
        row["norms"].append(float(pipe.clip_grad_norm_(MAX_NORM)))
        opt.step()
        opt.zero_grad()
    pipe.close()
    # the largest gradient difference over every process (each holds its own stages' shards)
    g = torch.tensor([grad_diff], device=device)
    dist.all_reduce(g, op=dist.ReduceOp.MAX)
    row["grad_max_diff"] = float(g)
    row["want_norms"] = want_norms
    row["loss_max_diff"] = max(abs(a - b) for a, b in zip(row["losses"], want_losses))
    row["norm_max_diff"] = max(abs(a - b) for a, b in zip(row["norms"], want_norms))
    row["ok"] = row["loss_max_diff"] <= tol
    return row


def layouts(world: int) -> list[tuple[int, int, dict]]:
    """(pp, tp, case) for this world: (pp=2, tp=world/2) under 1F1B and ZBV, (pp=1, tp=world)
    under 1F1B; where tp > 1 with and without sequence parallel."""
    out = []
    for pp in (2, 1):
        if world % pp:
            continue
        tp = world // pp
        if pp == 2:
            out.append((pp, tp, {"schedule": "1f1b", "stage_layers": [3, 3]}))
            out.append((pp, tp, {"schedule": "zbv", "stage_layers": [2, 1, 1, 2]}))
        else:
            out.append((pp, tp, {"schedule": "1f1b", "stage_layers": [6]}))
    cases = []
    for pp, tp, case in out:
        for sp in (False, True) if tp > 1 else (False,):
            cases.append((pp, tp, case | {"sequence_parallel": sp}))
    return cases


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON file for the rows (rank 0)")
    p.add_argument("--tol", type=float, default=1e-5, help="loss tolerance")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and args.device == "auto"
    local = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local)
        # TF32 off: the reference and the pipeline then agree to float32 rounding
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    want = reference(device)
    rows = []
    for pp, tp, case in layouts(world):
        t = time.perf_counter()
        try:
            row = run_layout(pp, tp, case, device, want, args.tol)
        except Exception as e:  # reported as a row; the later layouts would wait on a peer
            row = {"pp": pp, "tp": tp, **case, "ok": False, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
            print(f"[rank {rank}] pp={pp} tp={tp} {case}: {row['error']}", flush=True)
            break
        row["wall_s"] = time.perf_counter() - t
        rows.append(row)
        if rank == 0:
            print(
                f"pp={pp} tp={tp} {case['schedule']} sp={case['sequence_parallel']}: "
                f"loss {row['losses']} vs {want[0]} (max diff {row['loss_max_diff']:.2e}), "
                f"grad max diff {row['grad_max_diff']:.2e}, norm diff {row['norm_max_diff']:.2e} "
                f"-> {'OK' if row['ok'] else 'FAIL'}",
                flush=True,
            )
    ok = all(r["ok"] for r in rows) and bool(rows)
    if rank == 0:
        meta = {
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "backend": dist.get_backend(),
            "world": world,
            "torch": torch.__version__,
            "dtype": "float32",
            "tol": args.tol,
            "ok": ok,
        }
        print(json.dumps(meta), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
