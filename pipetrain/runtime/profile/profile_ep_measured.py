"""The profiler's expert-parallel numbers measured on a real group of ``ep`` worker processes
(NCCL on GPUs, one per GPU; gloo on a CPU; ``worker_group``): what ``pipetrain profile --ep E``
writes when the machine runs such a group, instead of deriving them.

* **The real dispatch.** Each rank builds the same layers (same seed, same weights), its caller's
  ``build`` sharding the experts on an ``("edp", "ep")`` mesh of ``(1, ep)`` with
  ``apply_expert_parallel`` — the function ``train --ep`` shards them with — and runs a
  micro-batch forward through the layers (each rank its own, as a job's replicas route
  different batches; ``build`` draws it). Each ``ExpertParallelExperts`` reports the rows its
  dispatch sends to every rank (``dispatch_observer``); the rows for the other ranks times the
  row's bytes are the layer's dispatched bytes on that rank, and the file keeps the largest over
  the ranks: the exchange waits for the slowest sender. A router routes unevenly (one with
  random weights more so), so this differs from the balanced ``tokens × top-k × (ep - 1) / ep``
  derivation (``planner.costs_file_moe.dispatched_bytes``): the point of measuring it.
* **The link.** ``all_to_all_single`` on the ``ep`` group of buffers whose share crossing to the
  other ranks is half, once and twice the largest dispatched bytes, the median of ``repeats``
  rounds (each after a barrier; the slowest rank's), turned into GB/s as
  ``planner.costs_file_moe.all_to_all_ms`` prices an exchange (bytes crossing per rank over
  time, no latency term): the link the simulator should be given to predict the layer's own
  exchange, so the file's ``ep_link_gbs`` is the one at the dispatched size and the other two
  are kept beside it (small exchanges are latency-bound: their GB/s are lower).

Rank 0 writes the results to a file the parent reads; a worker that fails or a group that
outlives ``timeout_s`` ends the measurement with one ``ValueError`` line.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.runtime.profile.profile_clock import Clock
from pipetrain.runtime.profile.worker_group import check_gpus, free_port, join_group, run_group

#: seconds the group may take before it is stopped (and its collectives' own timeout)
TIMEOUT_S = 600.0
#: the link is timed at these multiples of the largest dispatched bytes (the file keeps 1's)
LINK_SCALES = (0.5, 1.0, 2.0)

#: builds each rank's layers (in call order, their experts sharded over the ``("edp", "ep")``
#: mesh given) and their first inputs on ``device``; picklable, as the workers are spawned
Build = Callable[[Any, torch.device], tuple[Sequence[nn.Module], tuple[torch.Tensor, ...]]]


@dataclass(frozen=True)
class EpMeasured:
    """What the group measured: per MoE layer (its index in the layer list), the largest bytes
    a rank's dispatch sent to the other ranks, and the rows behind them; the link's GB/s at the
    dispatched size, and each timed size's ``{"bytes", "ms", "gbs"}``."""

    dispatched_bytes: dict[int, float]
    rows: dict[int, int]
    link_gbs: float
    link_points: list[dict[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class _Job:
    build: Build
    ep: int
    device_type: str
    repeats: int
    timeout_s: float
    port: int
    out: str


def measure_expert_parallel(
    build: Build, ep: int, device_type: str, *, repeats: int = 5, timeout_s: float = TIMEOUT_S
) -> EpMeasured:
    """The dispatch and the link measured on ``ep`` spawned processes (module docstring).
    ``ValueError``: too few GPUs, a worker failed (its error, one line), or the group did not
    finish within ``timeout_s``."""
    what = f"expert-parallel degree {ep}"
    check_gpus(device_type, ep, what)
    if device_type == "cuda":  # the parent's cached blocks on GPU 0, which rank 0 shares
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="pipetrain-ep-") as scratch:
        out = Path(scratch) / "ep.json"
        job = _Job(build, ep, device_type, repeats, timeout_s, free_port(), str(out))
        run_group(_worker, job, ep, f"measuring {what}", timeout_s)
        raw = json.loads(out.read_text())  # rank 0 wrote it before the group's last barrier
    return EpMeasured(
        dispatched_bytes={int(k): v for k, v in raw["bytes"].items()},
        rows={int(k): v for k, v in raw["rows"].items()},
        link_gbs=raw["link_gbs"],
        link_points=raw["points"],
    )


def _worker(rank: int, job: _Job) -> None:
    """One rank: join the group, shard the experts, count the dispatch, time the link; rank 0
    writes the group's results."""
    from torch.distributed.device_mesh import init_device_mesh

    device = join_group(rank, job.ep, job.device_type, job.port, job.timeout_s)
    try:
        mesh = init_device_mesh(device.type, (1, job.ep), mesh_dim_names=("edp", "ep"))
        layers, inputs = job.build(mesh, device)
        group = mesh.get_group("ep")
        sent, row_bytes, dtype = dispatched_rows(layers, inputs)
        indices = sorted(sent)
        counts = torch.tensor([sent[i] for i in indices], dtype=torch.float64, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
        rows = {i: int(n) for i, n in zip(indices, counts.tolist(), strict=True)}
        dispatched = {i: n * row_bytes for i, n in rows.items()}
        largest = max(dispatched.values(), default=0.0) or float(row_bytes)
        points = [link_point(group, device, largest * s, dtype, job.repeats) for s in LINK_SCALES]
        if rank == 0:
            result = {
                "bytes": dispatched,
                "rows": rows,
                "link_gbs": points[LINK_SCALES.index(1.0)]["gbs"],
                "points": points,
            }
            Path(job.out).write_text(json.dumps(result))
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group()


def dispatched_rows(
    layers: Sequence[nn.Module], inputs: tuple[torch.Tensor, ...]
) -> tuple[dict[int, int], int, torch.dtype]:
    """One forward of ``inputs`` through ``layers`` (up to the last MoE layer): per layer holding
    sharded experts (its index), the rows its dispatches sent from this rank to the other ranks;
    the bytes of one row; the rows' dtype. The sharded experts are found by their
    ``dispatch_observer`` (``runtime.parallel.expert_parallel.ExpertParallelExperts``)."""
    sent: dict[int, int] = {}
    shape: list[tuple[int, torch.dtype]] = []

    def observer(index: int, own: int) -> Callable[[list[int], torch.Tensor], None]:
        def seen(send: list[int], hidden: torch.Tensor) -> None:
            sent[index] += sum(send) - send[own]  # the rows kept on this rank cross no link
            shape.append((hidden[0].numel() * hidden.element_size(), hidden.dtype))

        return seen

    moe = []
    for i, layer in enumerate(layers):
        experts: list[Any] = [m for m in layer.modules() if hasattr(m, "dispatch_observer")]
        for m in experts:
            m.dispatch_observer = observer(i, int(m.ep_rank))
        if experts:
            sent[i] = 0
            moe.append(i)
    if not moe:
        raise ValueError("the layers hold no experts sharded over expert parallel")
    with torch.no_grad():
        for layer in layers[: max(moe) + 1]:
            out = layer(*inputs)
            inputs = out if isinstance(out, tuple) else (out,)
    if not shape:
        raise ValueError("the forward dispatched no tokens to the experts")
    return sent, shape[0][0], shape[0][1]


def link_point(
    group: Any, device: torch.device, crossing: float, dtype: torch.dtype, repeats: int
) -> dict[str, float]:
    """One all-to-all on ``group`` whose share for the other ranks is about ``crossing`` bytes
    per rank, timed (median of ``repeats`` after a warm-up, the slowest rank's): the bytes that
    crossed, the ms, and the GB/s ``planner.costs_file_moe.all_to_all_ms`` would need to price
    it so."""
    size = dist.get_world_size(group)
    element = torch.empty((), dtype=dtype).element_size()
    chunk = max(1, round(crossing / ((size - 1) * element)))  # elements per peer
    x = torch.ones(size * chunk, dtype=dtype, device=device)
    out = torch.empty_like(x)
    clock = Clock(device)
    times = []
    for _ in range(repeats + 1):  # the first round warms up
        dist.barrier(group=group)
        times.append(clock.time(lambda: dist.all_to_all_single(out, x, group=group))[0])
    ms = torch.tensor([statistics.median(times[1:])], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    crossed = float((size - 1) * chunk * element)
    slowest = max(float(ms.item()), 1e-6)
    return {"bytes": crossed, "ms": slowest, "gbs": crossed / (slowest * 1e6)}
