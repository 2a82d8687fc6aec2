"""The several-GPU MoE overlap benchmark (benchmarks/moe/moe_overlap_gpu.py): its CPU dry run on
gloo (4 processes, pp 2 × ep 2, a tiny Qwen3-MoE) writes every row with a step time and a
prediction; the trace reduction that gives the exposed all-to-all, on hand-made traces."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.moe.moe_overlap_gpu import main
from benchmarks.moe.moe_overlap_megatron import MEGATRON_ROW
from benchmarks.moe.moe_overlap_model import PRESETS, ROWS, cut
from benchmarks.moe.moe_overlap_predict import predict
from benchmarks.moe.moe_overlap_report import step_interval
from benchmarks.moe.moe_overlap_trace import (
    NOT_MEANINGFUL,
    exposed_all_to_all,
    hidden_share,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "moe" / "moe_overlap_gpu.py"


def _run(out: Path, *extra: str, timeout: int = 240) -> subprocess.CompletedProcess:
    argv = [sys.executable, str(SCRIPT), "--preset", "cpu-smoke", "--out", str(out), *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _check_prediction(pred: dict, link: str = "measured") -> None:
    assert pred["ep_link"] == link and pred["ep_link_gbs"] > 0
    assert pred["dispatched_bytes_per_layer"] > 0
    for row in ROWS:
        p = pred["rows"][row]
        assert p["step_ms"] > 0, row
        assert 0.0 <= p["hidden_share"] <= 1.0, row
        assert all(t > 0 for t in p["all_to_all_ms"]), row
    # only the overlapped pairs hide anything; the same schedule run pair by pair hides none
    assert pred["rows"]["dualpipev"]["hidden_share"] == 0.0
    assert pred["rows"]["dualpipev+overlap"]["hidden_share"] > 0.0


#: four gloo processes importing transformers: 20-50 s on 2 cores, the stress tier; the runtime's
#: exactness under the same layout is in the default tier (tests/runtime/test_pair_lanes.py)
@pytest.mark.stress
def test_cpu_smoke_writes_every_row_with_a_step_time_and_a_prediction(tmp_path: Path) -> None:
    done = _run(tmp_path, "--steps", "2", "--warmup", "0", "--launches", "1", "--megatron")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["meta"]["world"] == 4 and result["meta"]["backend"] == "gloo"
    assert set(result["rows"]) == set(ROWS) | {MEGATRON_ROW}
    megatron = result["rows"].pop(MEGATRON_ROW)  # a probe: the reason it does not run
    assert megatron["error"] and "torchtitan" in megatron["fallback"]
    for row, r in result["rows"].items():
        assert "error" not in r, (row, r)
        assert len(r["launches_ms"]) == 1 and len(r["launches_ms"][0]) == 2, row
        assert r["step_ms_low"] <= r["step_ms"] <= r["step_ms_high"], row
        assert r["step_ms"] > 0, row
    assert len(result["rows"]["dualpipev+overlap"]["over_plain"]) == 3
    _check_prediction(result["prediction"])
    table = (tmp_path / "table.md").read_text()
    assert all(f"| {row} |" in table for row in [*ROWS, MEGATRON_ROW]) and table in done.stdout


@pytest.mark.stress
def test_cpu_profile_mode_reports_the_all_to_all_from_cpu_events(tmp_path: Path) -> None:
    done = _run(tmp_path, "--profile", "--warmup", "1")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "profile.json").read_text())
    assert result["source"] == NOT_MEANINGFUL
    for row in ROWS:
        ranks = result["rows"][row]["ranks"]
        assert len(ranks) == 4 and all(r["all_to_all_ms"] > 0 for r in ranks), row
    assert isinstance(result["rows"]["dualpipev+overlap"]["hidden_share"], float)
    assert NOT_MEANINGFUL in (tmp_path / "table.md").read_text()
    _check_prediction(result["prediction"])


def test_predict_only_writes_the_prediction_from_this_device(tmp_path: Path) -> None:
    # in this process: no process group, the link given
    argv = ["--preset", "cpu-smoke", "--out", str(tmp_path), "--predict-only", "--ep-link-gbs", "2"]
    assert main(argv) == 0
    pred = json.loads((tmp_path / "prediction.json").read_text())
    _check_prediction(pred, link="given")
    assert pred["ep_link_gbs"] == 2.0
    # I is a difference of two medians, clamped at 0: on a loaded CPU it may be 0
    moe = pred["layers_ms"]["moe_layer"]
    assert moe["F"] > 0 and all(math.isfinite(moe[k]) and moe[k] >= 0 for k in "FIB"), moe


def test_the_simulator_prices_what_the_overlap_hides() -> None:
    """Fixed layer times on the 4-GPU shape (the all-to-all a visible share): the overlapped
    pairs hide part of it and shorten the step; the same schedule pair by pair, ZBV and 1F1B
    hide none; every row carries the same all-to-all."""
    layers = {
        "embedding": {"F": 0.1, "I": 0.0, "B": 0.2},
        "moe_layer": {"F": 3.0, "I": 3.0, "B": 6.0},
        "head": {"F": 2.0, "I": 2.0, "B": 4.0},
    }
    pred = predict(PRESETS["h200x4"], list(ROWS), layers, 150.0)
    # 4096 tokens × top-8 × hidden 2048 × 2 bytes, half of the copies leaving the rank
    assert pred["dispatched_bytes_per_layer"] == 4096 * 8 * 2048 * 2 / 2
    rows = pred["rows"]
    # 8 micro-batches × 4 layers a rank × (dispatch + combine) × (forward + backward)
    per_pass = 2 * pred["dispatched_bytes_per_layer"] / 150e6
    for row in ROWS:
        assert rows[row]["all_to_all_ms"] == pytest.approx([8 * 4 * 2 * per_pass] * 2), row
    assert 0.5 < rows["dualpipev+overlap"]["hidden_share"] < 1.0
    assert all(rows[r]["hidden_share"] == 0.0 for r in ("dualpipev", "zbv", "1f1b"))
    assert rows["dualpipev+overlap"]["step_ms"] < rows["dualpipev"]["step_ms"]
    assert rows["zbv"]["step_ms"] < rows["1f1b"]["step_ms"]


def test_refusals_are_one_line_before_any_process_starts(tmp_path: Path, capsys) -> None:
    out = str(tmp_path)
    assert main(["--preset", "cpu-smoke", "--out", out, "--ep", "3"]) == 2
    assert capsys.readouterr().err.strip() == "error: --ep 3 must divide the 4 experts"
    assert main(["--preset", "cpu-smoke", "--out", out, "--predict-only"]) == 2
    assert "--predict-only needs --ep-link-gbs" in capsys.readouterr().err
    assert main(["--preset", "cpu-smoke", "--out", out, "--microbatches", "3"]) == 2
    assert "--microbatches must be >= 2·pp = 4" in capsys.readouterr().err


def _kernel(ts, dur, name, stream, corr):
    args = {"stream": stream, "correlation": corr}
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 0,
        "tid": stream,
        "args": args,
    }


def _host(cat, ts, dur, name, corr=None, args=None):
    a = dict(args or {}) | ({"correlation": corr} if corr is not None else {})
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "pid": 9,
        "tid": 1,
        "args": a,
    }


def test_exposed_all_to_all_is_the_all_to_all_kernel_time_no_compute_covers() -> None:
    events = [
        # host: an all-to-all launching kernel 1, a P2P send launching kernel 2, a matmul 3
        _host("user_annotation", 0, 10, "nccl:all_to_all"),
        _host("cuda_runtime", 2, 1, "cudaLaunchKernelExC", corr=1),
        _host("cpu_op", 20, 10, "nccl:send 0->1"),
        _host("cuda_runtime", 22, 1, "cudaLaunchKernelExC", corr=2),
        _host("cpu_op", 30, 5, "record_param_comms", args={"Collective name": "all_to_allv"}),
        _host("cuda_runtime", 31, 1, "cuLaunchKernelEx", corr=4),
        _host("cuda_runtime", 40, 1, "cudaLaunchKernel", corr=3),
        # device: all-to-all 100-200 under compute 150-180 on stream 7 → 70 exposed; the send's
        # kernel (not an all-to-all) and the second all-to-all 300-310 fully exposed
        _kernel(100, 100, "ncclDevKernel_SendRecv", 20, 1),
        _kernel(150, 30, "ampere_bf16_gemm", 7, 3),
        _kernel(150, 200, "ncclDevKernel_SendRecv", 21, 2),
        _kernel(300, 10, "ncclDevKernel_SendRecv", 20, 4),
        # a kernel inside a GPU-side all-to-all annotation on its own stream counts too
        {**_kernel(400, 20, "ncclDevKernel_SendRecv", 22, 5)},
        {
            "ph": "X",
            "cat": "gpu_user_annotation",
            "name": "nccl:all_to_all",
            "ts": 399,
            "dur": 30,
            "pid": 0,
            "tid": 22,
        },
    ]
    got = exposed_all_to_all(events)
    assert got["source"] == "gpu"
    assert got["all_to_all_kernels"] == 3
    assert got["all_to_all_ms"] == pytest.approx((100 + 10 + 20) / 1e3)
    assert got["exposed_ms"] == pytest.approx((70 + 10 + 20) / 1e3)
    assert got["compute_ms"] == pytest.approx(30 / 1e3)
    # a kernel whose launch was not recorded, linked to its all-to-all by its External id
    linked = _kernel(500, 40, "ncclDevKernel_SendRecv", 20, 6)
    linked["args"]["External id"] = 77
    op = _host("cpu_op", 600, 5, "c10d::alltoall_base_", args={"External id": 77})
    got = exposed_all_to_all([*events, linked, op])
    assert got["all_to_all_kernels"] == 4
    assert got["exposed_ms"] == pytest.approx((70 + 10 + 20 + 40) / 1e3)


def test_on_cpu_the_all_to_all_is_the_union_of_its_ranges_all_exposed() -> None:
    events = [
        _host("user_annotation", 0, 10, "gloo:all_to_all"),
        _host("cpu_op", 2, 5, "c10d::alltoall_base_"),  # inside the one above: counted once
        _host("cpu_op", 20, 4, "aten::mm"),
        _host("cpu_op", 30, 6, "c10d::alltoall_base_"),
    ]
    got = exposed_all_to_all(events)
    assert got["source"] == NOT_MEANINGFUL
    assert got["all_to_all_ms"] == pytest.approx(16 / 1e3) == got["exposed_ms"]


def test_hidden_share_and_step_interval() -> None:
    assert hidden_share([1.0, 1.0], [4.0, 4.0]) == pytest.approx(0.75)
    assert hidden_share([1.0], [0.0]) is None
    launches = [[10.0, 11.0, 30.0], [12.0, 12.0, 13.0], [9.0, 10.0, 11.0]]
    est, lo, hi = step_interval(launches)
    assert est == pytest.approx((11 + 12 + 10) / 3)
    assert 9.0 <= lo <= est <= hi <= 30.0 and lo < hi
    assert step_interval([[5.0, 5.0]]) == (5.0, 5.0, 5.0)


def test_cut_puts_the_embedding_first_and_the_head_last() -> None:
    assert cut(8, 4) == [3, 2, 2, 4]
    assert cut(5, 2) == [4, 4]  # 3 layers + embedding, 2 layers + norm + head
    assert sum(cut(8, 2)) == 8 + 3
    with pytest.raises(ValueError, match="cannot fill"):
        cut(2, 4)
