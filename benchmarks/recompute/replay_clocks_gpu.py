"""Does a replayed stage run slower the longer the device runs without a pause? (a benchmark,
not a test; docs/planning.md, "Where a replayed step's excess comes from").

A replayed stage (``recompute_price_gpu``: ``--blocks`` blocks, ``--microbatches`` forwards then
backwards, plain and fully recomputed) is timed replay by replay, once back to back and once
after an idle pause before each, while ``nvidia-smi`` samples the SM clock and the power draw.
Beside it, the same stage's busy time launched kernel by kernel (device clock, profiler). If the
device lowers its clock under sustained load, the back-to-back replays are slower than the
paused ones and the clock samples say by how much.

    python3 benchmarks/recompute/replay_clocks_gpu.py --out $OUT
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.recompute.recompute_price_gpu import (
    build,
    capture,
    stage_parser,
    stage_setup,
    step_fn,
    write_report,
)
from pipetrain.runtime.profile.profile_clock import DeviceClock, busy_us


def replays(graph, count: int, pause_s: float) -> list[float]:
    """ms of each of ``count`` replays, ``pause_s`` of idle device before each."""
    out = []
    for _ in range(count):
        if pause_s:
            time.sleep(pause_s)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out


def sampled(fn):
    """``fn()`` while nvidia-smi samples SM clock (MHz) and power (W) every 20 ms."""
    query = ["nvidia-smi", "-i", "0", "--query-gpu=clocks.sm,power.draw",
             "--format=csv,noheader,nounits", "-lms", "20"]  # fmt: skip
    probe = subprocess.Popen(query, stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    result = fn()
    probe.terminate()
    rows = []
    for line in probe.communicate()[0].splitlines():
        try:
            clock, power = (float(v) for v in line.split(","))
            rows.append((clock, power))
        except ValueError:
            continue
    return result, rows


def main() -> int:
    p = stage_parser(__doc__ or "")
    p.add_argument("--count", type=int, default=30)
    p.add_argument("--pause-s", type=float, default=0.3)
    args = p.parse_args()
    cfg, device, dtype, x, grads, out = stage_setup(args)
    m = args.microbatches
    clock = DeviceClock(device)
    for mode in ("none", "full"):
        runner = build(cfg, args.blocks, mode, device, dtype)
        step = step_fn(runner, x, grads, m)
        graph = capture(step)
        busy = [busy_us(clock.spans(step)[0]) / 1e3 for _ in range(3)]
        paused, paused_smi = sampled(partial(replays, graph, args.count // 3, args.pause_s))
        steady, steady_smi = sampled(partial(replays, graph, args.count, 0.0))
        row = {
            "busy_ms": busy,
            "paused_ms": paused,
            "back_to_back_ms": steady,
            "paused_median": statistics.median(paused),
            "back_to_back_first5": statistics.median(steady[:5]),
            "back_to_back_last5": statistics.median(steady[-5:]),
            "smi_paused": paused_smi,
            "smi_back_to_back": steady_smi,
        }
        out["modes"][mode] = row
        clocks = [c for c, _ in steady_smi]
        print(f"{mode}: busy {statistics.median(busy):.2f} ms; replays paused "
              f"{row['paused_median']:.2f}, back to back first {row['back_to_back_first5']:.2f} "
              f"last {row['back_to_back_last5']:.2f} ms; SM clock back to back "
              f"{min(clocks, default=0):.0f}-{max(clocks, default=0):.0f} MHz, power max "
              f"{max((w for _, w in steady_smi), default=0):.0f} W", flush=True)  # fmt: skip
        del graph, runner, step
        torch.cuda.empty_cache()
    write_report(args.out, "replay_clocks.json", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
