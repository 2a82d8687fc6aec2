"""Two profiled steps' device kernels side by side (a benchmark tool, not a test;
docs/incumbents.md, "4 ranks: the clock over the timed steps, and one profiled step").

Where two libraries run the same kernels the same number of times and one step is still slower,
the question is whether its kernels run longer, and whether they do so from the start of the step
or more and more as it goes on (a device that lowers its clock under sustained power draw slows
every kernel, later ones more). Per kernel name: total ms and calls in each trace; per matrix
product (name and grid), its median duration in each of ``--bins`` equal slices of the step;
per slice, the share of time the device ran compute kernels (density) and NCCL kernels.

    python3 benchmarks/incumbents/trace_kernels.py A.json.gz B.json.gz [--top 12] [--bins 8]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

KINDS = ("kernel", "gpu_memset", "gpu_memcpy")


def kernels(path: Path) -> list[dict]:
    """The trace's device events (kernels, memsets, copies) in start order."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    out = [e for e in events if e.get("ph") == "X" and e.get("cat") in KINDS]
    return sorted(out, key=lambda e: e["ts"])


def totals(events: list[dict]) -> dict[str, tuple[float, int]]:
    """Kernel name -> (total ms, calls)."""
    out: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        out[e["name"]][0] += e["dur"] / 1e3
        out[e["name"]][1] += 1
    return {k: (v[0], int(v[1])) for k, v in out.items()}


def slices(events: list[dict], bins: int) -> dict[str, list]:
    """Per matrix product (name, grid) its median µs in each slice; ``density`` and ``nccl``:
    the share of each slice the device spent in compute and in NCCL kernels."""
    start = events[0]["ts"]
    span = max(e["ts"] + e["dur"] for e in events) - start
    width = span / bins
    gemms: dict[str, list[list[float]]] = defaultdict(lambda: [[] for _ in range(bins)])
    busy = {"density": [0.0] * bins, "nccl": [0.0] * bins}
    for e in events:
        k = min(bins - 1, int((e["ts"] - start) / width))
        busy["nccl" if "nccl" in e["name"].lower() else "density"][k] += e["dur"] / width
        if e["name"].startswith(("nvjet", "sm90_xmma", "ampere_", "cutlass")):
            gemms[f"{e['name'][-24:]} grid {e['args'].get('grid')}"][k].append(e["dur"])
    out: dict[str, list] = dict(busy)
    for name, per in sorted(gemms.items(), key=lambda kv: -sum(map(len, kv[1])))[:6]:
        out[name] = [statistics.median(v) if v else None for v in per]
    return out


def compare(a: Path, b: Path, top: int, bins: int) -> str:
    ea, eb = kernels(a), kernels(b)
    ta, tb = totals(ea), totals(eb)
    lines = [f"A = {a.name}, B = {b.name}", "", "| A ms | A calls | B ms | B calls | kernel |"]
    lines.append("|---|---|---|---|---|")
    names = sorted(
        set(ta) | set(tb), key=lambda n: -abs(ta.get(n, (0, 0))[0] - tb.get(n, (0, 0))[0])
    )
    for n in names[:top]:
        (ma, ca), (mb, cb) = ta.get(n, (0.0, 0)), tb.get(n, (0.0, 0))
        lines.append(f"| {ma:.2f} | {ca} | {mb:.2f} | {cb} | {n[:100]} |")
    for label, events in (("A", ea), ("B", eb)):
        lines += ["", f"{label}: per slice of the step ({bins})"]
        for name, row in slices(events, bins).items():
            cells = " ".join("-" if v is None else f"{v:.2f}" if v < 2 else f"{v:.0f}" for v in row)
            lines.append(f"  {name}: {cells}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--bins", type=int, default=8)
    a = p.parse_args()
    print(compare(a.a, a.b, a.top, a.bins))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
