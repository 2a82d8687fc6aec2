"""The process context of ``moe_overlap_gpu.py``: the process group (NCCL on GPUs, gloo on the
CPU), the ``("pp", "edp", "ep")`` mesh, the master weights and this replica's batch, and
``guarded``, which turns any rank's failure into one error row on every rank."""

from __future__ import annotations

import argparse
import gc
import time
import traceback

import torch

from benchmarks.common.gpu_setup import Processes
from benchmarks.moe import moe_overlap_model as mm

#: set (unless already set) before NCCL and the caching allocator start
CUDA_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}


class Run(Processes):
    """One process's state: its arguments, device, mesh and the master weights (with what
    ``gpu_setup.time_steps`` and ``slowest`` use: ``args``, ``sync``, ``barrier``, ``gather``)."""

    def __init__(self, args: argparse.Namespace, shape: mm.Shape) -> None:
        # NVLink multicast off (it can take a shared host's GPUs down), one allocator setting
        super().__init__(shape.device == "cuda", args.pg_timeout, CUDA_ENV)
        self.args, self.shape = args, shape
        self.mesh = mm.make_mesh(shape, self.device)
        self.master = mm.build_master(shape, self.device)
        self.ids = mm.batch(shape, mm.replica_of(self.mesh), self.device)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)

    def mem_reset(self) -> int:
        gc.collect()
        if not self.cuda:
            return 0
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        return torch.cuda.memory_allocated(self.device)

    def pipeline(self, row: str):
        a = self.args
        return mm.make_pipeline(row, self.shape, self.master, self.mesh, self.device, a.op_timeout)


def optimizer(params) -> torch.optim.Optimizer:
    """AdamW with the expert shards (``DTensor``s) in a group of their own: its fused per-device
    (``foreach``) step refuses a list mixing them with plain tensors, as on CUDA."""
    from torch.distributed.tensor import DTensor

    params = list(params)
    groups = [
        {"params": [p for p in params if isinstance(p, DTensor) == sharded]}
        for sharded in (False, True)
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=1e-4)


def guarded(run: Run, what: str, fn) -> dict:
    """``fn()`` on every rank; any rank's exception makes an error row on all of them."""
    try:
        row, err = fn(), None
    except Exception as e:
        row, err = {}, f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if run.args.verbose:
            traceback.print_exc()
    errors = [e for e in run.gather(err) if e]
    if errors:
        run.log(f"{what}: ERROR {errors[0]}")
        return {"error": errors[0]}
    return row
