"""The experts benchmark's CPU smoke (``benchmarks/moe/experts_gpu.py --preset cpu``): every
shape times the grouped path, the loop and the dense MLP, checks grouped against loop within
the stated tolerance, and writes its JSON and table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from benchmarks.moe import experts_gpu


def test_cpu_preset_times_all_variants_and_checks_grouped_against_loop(tmp_path: Path) -> None:
    assert experts_gpu.main(["--preset", "cpu", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert list(result["shapes"]) == list(experts_gpu.PRESETS["cpu"]["shapes"])
    for shape in result["shapes"].values():
        assert list(shape["timings"]) == list(experts_gpu.VARIANTS)
        # two medians measured apart: each positive, their order not asserted (a loaded CPU)
        assert all(
            t["forward_backward_ms"] > 0 and t["forward_ms"] > 0 for t in shape["timings"].values()
        )
        check = shape["check"]
        assert check["ok"] and check["tolerance"] == experts_gpu.TOLERANCE["float32"]
        grads = [k for k in check if k.startswith("grad experts.")]
        assert len(grads) == 2 and "grad input" in check and "grad gate.weight" in check
        assert 0 <= check["worst_rel"] <= check["tolerance"]
    assert result["rule"].startswith("experts: loop over experts (eager) on cpu float32")
    table = (tmp_path / "results.md").read_text()
    assert table.count("| grouped_mm |") == 2 and "| yes |" in table


def test_a_grouped_path_that_differs_from_the_loop_fails_the_check(monkeypatch) -> None:
    """The check reads what it compares: a grouped path off by 1 % is reported as failing."""
    import torch

    shape = experts_gpu.SHAPES["tiny-mixtral"]
    config, block, _ = experts_gpu.build(shape, torch.device("cpu"), torch.float32)
    x = torch.randn(1, 16, 32, requires_grad=True)
    grad = torch.randn_like(x)
    original = experts_gpu.outputs_and_grads

    def skewed(block, x, grad):
        got = original(block, x, grad)
        if config._experts_implementation == "grouped_mm":
            got["output"] = got["output"] * 1.01
        return got

    monkeypatch.setattr(experts_gpu, "outputs_and_grads", skewed)
    check = experts_gpu.compare(config, block, x, grad, "float32")
    assert not check["ok"] and check["output"]["max_rel"] > 0.009
