"""trace_kernels.py: kernel totals per trace and each matrix product's duration per slice of the
step, from Chrome traces as torch.profiler writes them."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.incumbents.trace_kernels import compare, slices


def trace(path: Path, gemm_us: list[float], nccl_us: float) -> Path:
    """One step: the matrix products back to back, then one NCCL kernel."""
    events, t = [], 0.0
    for dur in gemm_us:
        events.append({"ph": "X", "cat": "kernel", "name": "nvjet_tst_NNT", "ts": t, "dur": dur,
                       "args": {"grid": [2, 66, 1]}})  # fmt: skip
        t += dur
    events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": t,
                   "dur": nccl_us, "args": {}})  # fmt: skip
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5.0})
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def test_a_kernel_that_slows_down_later_in_the_step_shows_per_slice(tmp_path: Path) -> None:
    slow = trace(tmp_path / "a.json.gz", [100.0] * 4 + [120.0] * 4, 0.0)
    steady = trace(tmp_path / "b.json.gz", [100.0] * 8, 200.0)
    text = compare(slow, steady, top=5, bins=2)
    assert "| 0.88 | 8 | 0.80 | 8 | nvjet_tst_NNT |" in text
    assert "| 0.00 | 1 | 0.20 | 1 | ncclDevKernel_SendRecv |" in text
    per = slices(json.loads(gzip.open(slow, "rt").read())["traceEvents"][:-1], 2)
    assert per["nvjet_tst_NNT grid [2, 66, 1]"] == [100.0, 120.0]
    assert per["density"][0] > 0.9 and per["nccl"] == [0.0, 0.0]
