"""The exposed expert all-to-all of one profiled step, from a rank's ``torch.profiler`` trace
(the Chrome trace ``export_chrome_trace`` writes; standard library only).

**On the GPU** the question is how long the compute stream waits on all-to-all. A kernel is an
*all-to-all kernel* when it is an NCCL kernel launched from inside an all-to-all: its launch (the
CUDA runtime or driver call with the kernel's ``correlation`` id) lies, on the same host thread,
inside a CPU range whose name says all-to-all (``nccl:all_to_all``, ``c10d::alltoall_base_``,
or ``record_param_comms`` whose ``Collective name`` is one), or its ``External id`` (kineto's link
from a kernel to the host operation that launched it) is such a range's, or the kernel lies
inside a GPU-side annotation of that name on its own stream (kineto's ``gpu_user_annotation``). That picks the
dispatch, the combine, their backward exchanges and the small count exchange of
``runtime.parallel.expert_parallel``, and leaves out the pipeline's P2P sends (NCCL ``SendRecv``
kernels too, but launched from ``send``/``recv``) and data parallel's all-reduce. *Compute* is
every kernel that is not NCCL's, on whatever stream (the main stream, the overlap lane's side
stream). Then, per rank::

    all_to_all = |∪ all-to-all kernels|        exposed = |∪ all-to-all kernels  −  ∪ compute|

the time an all-to-all kernel runs while no compute kernel runs anywhere on the device: the
compute stream is waiting (for the exchange, or for a peer that has not reached it yet: an
all-to-all kernel spins until every rank joins, and that skew is exposed too). A step that
overlaps well runs its all-to-all under another micro-batch's kernels, so its exposed time
shrinks while its all-to-all time does not. The hidden share of an overlapping row against the
same schedule without overlap is ``1 − exposed(overlap) / exposed(no overlap)``, over all ranks.

**On the CPU** (gloo) there are no kernels and no streams: the all-to-all time is the union of
the CPU ranges named all-to-all, every bit of it counted as exposed. It shows the plumbing runs;
it is marked "cpu, not meaningful".
"""

from __future__ import annotations

import bisect
import gzip
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

Interval = tuple[float, float]
_A2A_WORDS = ("all_to_all", "alltoall")
#: trace categories of host calls that launch a kernel
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
NOT_MEANINGFUL = "cpu, not meaningful"


def load_trace(path: str | Path) -> list[dict]:
    """The events of a Chrome trace (``.json`` or ``.json.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: Sequence[Interval]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """The time two unions (sorted, disjoint) have in common."""
    i = j = 0
    common = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        common += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return common


def _span(e: dict) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e["dur"])


def is_all_to_all_range(e: dict) -> bool:
    """A host or GPU annotation range that is an all-to-all (by its name or its collective)."""
    name = str(e.get("name", "")).lower()
    collective = str((e.get("args") or {}).get("Collective name", "")).lower()
    return any(w in name or w in collective for w in _A2A_WORDS)


def _is_nccl(e: dict) -> bool:
    return "nccl" in str(e.get("name", "")).lower()


def _inside(spans: dict, key, point: float) -> bool:
    """Whether ``point`` lies in one of the (sorted, disjoint) spans under ``key``."""
    merged = spans.get(key, [])
    k = bisect.bisect_right(merged, (point, float("inf"))) - 1
    return k >= 0 and merged[k][0] <= point <= merged[k][1]


def classify_kernels(events: Sequence[dict]) -> tuple[list[Interval], list[Interval]]:
    """(all-to-all kernels, compute kernels) of a GPU trace (module docstring)."""
    host: dict = {}
    device: dict = {}
    for e in events:
        if not is_all_to_all_range(e):
            continue
        where = device if e.get("cat") == "gpu_user_annotation" else host
        where.setdefault((e.get("pid"), e.get("tid")), []).append(_span(e))
    host = {k: union(v) for k, v in host.items()}
    device = {k: union(v) for k, v in device.items()}
    launched_in_a2a = {
        (e.get("args") or {}).get("correlation")
        for e in events
        if e.get("cat") in _LAUNCH_CATS and _inside(host, (e.get("pid"), e.get("tid")), e["ts"])
    }
    launched_in_a2a.discard(None)
    a2a_ops = {
        (e.get("args") or {}).get("External id")
        for e in events
        if e.get("cat") in ("cpu_op", "user_annotation") and is_all_to_all_range(e)
    }
    a2a_ops.discard(None)
    a2a, compute = [], []
    for e in events:
        if e.get("cat") != "kernel":
            continue
        if not _is_nccl(e):
            compute.append(_span(e))
            continue
        start, end = _span(e)
        key = (e.get("pid"), e.get("tid"))
        mid = (start + end) / 2
        args = e.get("args") or {}
        if (
            args.get("correlation") in launched_in_a2a
            or args.get("External id") in a2a_ops
            or _inside(device, key, mid)
        ):
            a2a.append((start, end))
    return a2a, compute


def exposed_all_to_all(events: Sequence[dict]) -> dict:
    """One rank's profiled step: its all-to-all time and the part no compute covers (ms), the
    device-busy span, and whether it came from the GPU or only from the CPU (module docstring)."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if kernels:
        a2a, compute = classify_kernels(events)
        a2a_u, compute_u = union(a2a), union(compute)
        total = length(a2a_u)
        exposed = total - overlap(a2a_u, compute_u)
        busy = union(_span(e) for e in kernels)
        return {
            "source": "gpu",
            "all_to_all_kernels": len(a2a),
            "all_to_all_ms": total / 1e3,
            "exposed_ms": exposed / 1e3,
            "compute_ms": length(compute_u) / 1e3,
            "span_ms": (busy[-1][1] - busy[0][0]) / 1e3 if busy else 0.0,
        }
    ranges = [
        _span(e)
        for e in events
        if e.get("cat") in ("cpu_op", "user_annotation") and is_all_to_all_range(e)
    ]
    host = union(ranges)
    total = length(host)
    return {
        "source": NOT_MEANINGFUL,
        "all_to_all_ops": len(ranges),
        "all_to_all_ms": total / 1e3,
        "exposed_ms": total / 1e3,
    }


def hidden_share(exposed_overlap: Sequence[float], exposed_plain: Sequence[float]) -> float | None:
    """``1 − Σ exposed(overlap) / Σ exposed(no overlap)`` over the ranks; ``None`` when the row
    without overlap exposes nothing (nothing to hide)."""
    plain = sum(exposed_plain)
    return 1.0 - sum(exposed_overlap) / plain if plain > 0 else None
