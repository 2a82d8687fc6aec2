"""The host link as activation offload uses it (a benchmark, not a test; docs/planning.md,
"Offload's price"): GB/s of copies between the GPU and pinned host memory, device to host alone,
host to device alone, and both at once on two streams (what a pipeline's steady state runs: one
micro-batch's activations leave while another's come back; what the profiler's
``host_bandwidth_gbs`` now times), at a few sizes (``runtime.profile.host_link.link_gbs``).

    python3 benchmarks/offload/host_link_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from pipetrain.runtime.profile.host_link import link_gbs

SIZES_MIB = (8, 32, 128, 512)


def measure(device: torch.device, mib: int, reps: int) -> dict:
    n = mib << 20
    down = link_gbs(device, n, reps, ("down",))
    up = link_gbs(device, n, reps, ("up",))
    both = link_gbs(device, n, reps)
    return {
        "mib": mib,
        "d2h_gbs": down,
        "h2d_gbs": up,
        "both_per_direction_gbs": both,
        "both_over_slower_alone": min(down, up) / both,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("host_link_gpu.py measures a CUDA device's host link; none here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    rows = [measure(device, mib, args.reps) for mib in SIZES_MIB]
    for r in rows:
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out = {"device": torch.cuda.get_device_name(), "rows": rows}
        (Path(args.out) / "host_link.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
