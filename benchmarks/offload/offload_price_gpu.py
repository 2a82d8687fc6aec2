"""What activation offload costs one eager stage, and where (a benchmark, not a test;
docs/planning.md, "Offload's price").

The stage of ``recompute_price_gpu`` (``--blocks`` blocks of the planner benchmark's GPT,
``--microbatches`` forwards then as many backwards through a ``StageRunner``) runs plain and
with a ``StageOffload`` of each fraction in ``--fractions``: every forward is followed by its
``OFFLOAD``, and each backward is preceded by the next micro-batch's ``RELOAD``, as a program
issues them ahead. Per mode:

* ``eager``: CUDA events around the step (what an eager pipeline pays);
* ``busy``: the device's busy time under ``torch.profiler``, and of it ``d2h_ms`` / ``h2d_ms``,
  the copies' own busy time per direction, against ``link_ms``: the bytes moved over the host
  link's both-directions speed (``host_link.link_gbs``, what the profiler prices a copy at);
* ``host``: one step's CUDA calls that wait and its busiest host operators.

The excess over the plain stage per block and micro-batch, eagerly and as busy time, says
whether offload's cost is the link (busy grows by the copies that do not overlap), the device
(compute slowed by the copies' memory traffic) or the host (eager grows, busy does not).

    python3 benchmarks/offload/offload_price_gpu.py --out $OUT
    python3 benchmarks/offload/offload_price_gpu.py --preset cpu-smoke   # CPU: plain copies of every
                                                                     # saved tensor, eager
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.common.gpu_setup import allocator_counts
from benchmarks.recompute.recompute_price_gpu import (
    build,
    host_calls,
    stage_parser,
    stage_setup,
    timed,
    write_report,
)
from pipetrain.runtime.host_offload import MIN_BYTES, StageOffload, stage_layers
from pipetrain.runtime.profile import host_link
from pipetrain.runtime.profile.profile_clock import Clock, DeviceClock, busy_us
from pipetrain.runtime.stage import StageRunner


def offloading_step(runner: StageRunner, x: torch.Tensor, grads: list[torch.Tensor], m: int):
    offload = runner.offload

    def step() -> None:
        runner.begin_step()
        for mb in range(m):
            runner.forward(mb, (x,), None, 1.0)
            if offload is not None:
                offload.offload(mb)
        if offload is not None:
            offload.reload(0)
        for mb in range(m):
            if offload is not None and mb + 1 < m:
                offload.reload(mb + 1)  # ahead of the backward that needs it
            runner.backward(mb, [grads[mb]])

    return step


def copy_busy(step) -> dict[str, float]:
    """ms the device spent copying each way during one ``step``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    spans: dict[str, list[tuple[float, float]]] = {"d2h_ms": [], "h2d_ms": []}
    for e in prof.events():
        name = e.name.lower()
        key = "d2h_ms" if "dtoh" in name else "h2d_ms" if "htod" in name else None
        if key is not None:
            spans[key].append((e.time_range.start, e.time_range.end))
    return {k: busy_us(v) / 1e3 for k, v in spans.items()}


def main() -> int:
    p = stage_parser(__doc__ or "")
    p.add_argument("--fractions", default="0.5,1")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    cfg, device, dtype, x, grads, out = stage_setup(args)
    cuda = device.type == "cuda"
    m, k = args.microbatches, args.blocks
    t0 = time.perf_counter()
    gbs = host_link.link_gbs(device, repeats=5) if cuda else None
    out["link_gbs_both_ways"] = gbs
    print(f"host link, each way with both busy: {gbs} GB/s", flush=True)
    clock = DeviceClock(device) if cuda else Clock(device)
    for fraction in (0.0, *(float(f) for f in args.fractions.split(","))):
        runner = build(cfg, k, "none", device, dtype)
        if fraction > 0:
            runner.offload = StageOffload(
                1, fraction, frozenset(range(m)), device, min_bytes=MIN_BYTES if cuda else 0,
                layers=stage_layers(runner.module), params=list(runner.module.parameters()),
            )  # fmt: skip
        step = offloading_step(runner, x, grads, m)
        step()
        before = allocator_counts(device)
        row: dict = {"eager": timed(step, Clock(device), args.reps)}
        if cuda:  # retries: the allocator freed its cache and synchronised to find memory
            after = allocator_counts(device)
            row["allocator_retries"], row["device_allocs"] = (a - b for a, b in zip(after, before))
        if runner.offload is not None:
            runner.offload.moved_bytes = 0
            step()
            row["moved_gb"] = runner.offload.moved_bytes / 1e9
        if cuda:
            spans, _ = clock.spans(step)
            row["busy"] = busy_us(spans) / 1e3
            row.update(copy_busy(step))
            if gbs and "moved_gb" in row:
                row["link_ms"] = row["moved_gb"] / gbs * 1e3
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            row["host"] = host_calls(step)
        out["modes"][f"offload {fraction:g}"] = row
        print(f"offload {fraction:g}: {json.dumps(row)}  ({time.perf_counter() - t0:.0f} s)",
              flush=True)  # fmt: skip
        del runner, step
        if cuda:
            torch.cuda.empty_cache()
    base = out["modes"]["offload 0"]
    for mode, row in out["modes"].items():
        if mode != "offload 0":
            per = {c: (row[c] - base[c]) / (k * m) for c in ("eager", "busy") if c in row}
            row["excess_per_block_mb"] = per
            line = ", ".join(f"{c} {v:.4f}" for c, v in per.items())
            print(f"{mode}: excess per block and micro-batch (ms): {line}", flush=True)
    write_report(args.out, "offload_price.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
