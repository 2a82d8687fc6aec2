"""The host link as activation offload uses it (a benchmark, not a test; docs/planning.md,
"Offload's price"): GB/s of copies between the GPU and pinned host memory, device to host alone,
host to device alone, and both at once on two streams (what a pipeline's steady state runs: one
micro-batch's activations leave while another's come back), at a few sizes.

    python3 benchmarks/gpu/host_link_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

SIZES_MIB = (8, 32, 128, 512)


def gbs(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def timed(fn, reps: int) -> float:
    """Median ms of ``fn`` (which may use other streams; it joins them before returning)."""
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def measure(mib: int, reps: int) -> dict:
    n = mib << 20
    dev_out = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)
    dev_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_in = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    down, up = torch.cuda.Stream(), torch.cuda.Stream()
    main = torch.cuda.current_stream()

    def on(stream, copy):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            copy()
        main.wait_stream(stream)

    def d2h():
        on(down, lambda: host_out.copy_(dev_out, non_blocking=True))

    def h2d():
        on(up, lambda: dev_in.copy_(host_in, non_blocking=True))

    def both():
        down.wait_stream(main)
        up.wait_stream(main)
        with torch.cuda.stream(down):
            host_out.copy_(dev_out, non_blocking=True)
        with torch.cuda.stream(up):
            dev_in.copy_(host_in, non_blocking=True)
        main.wait_stream(down)
        main.wait_stream(up)

    alone_d, alone_u, together = timed(d2h, reps), timed(h2d, reps), timed(both, reps)
    return {
        "mib": mib,
        "d2h_gbs": gbs(n, alone_d),
        "h2d_gbs": gbs(n, alone_u),
        "both_ms": together,
        "both_per_direction_gbs": gbs(n, together),
        "both_over_slower_alone": together / max(alone_d, alone_u),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("host_link_gpu.py measures a CUDA device's host link; none here", file=sys.stderr)
        return 2
    rows = [measure(mib, args.reps) for mib in SIZES_MIB]
    for r in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = {"device": torch.cuda.get_device_name(), "rows": rows}
        (Path(args.out) / "host_link.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
