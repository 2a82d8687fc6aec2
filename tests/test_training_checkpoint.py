"""Checkpoints that reshard: saved at pp=2, continued bit for bit at pp=2, pp=4 and pp=1."""

from __future__ import annotations

import numpy as np
import pytest
from runtime_harness import launch
from training_cases import run_checkpoints


def _union(parts) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for part in parts:
        out.update(part)
    return out


@pytest.mark.slow
def test_checkpoint_written_at_pp2_continues_bit_identically_at_pp2_pp4_and_pp1(tmp_path):
    results = launch(4, run_checkpoints, str(tmp_path / "ckpt"), timeout=240)
    uninterrupted = _union(r["uninterrupted"] for r in results[:2])
    assert len(uninterrupted) == 10  # 6 layers' parameters: the ranks' parts are the model
    runs = {
        "same layout": _union(r["same_layout"] for r in results[2:]),
        "pp=4": _union(r["pp4"] for r in results),
        "pp=1": results[0]["pp1"],
    }
    for what, final in runs.items():
        assert sorted(final) == sorted(uninterrupted), what
        differ = [n for n in final if not np.array_equal(final[n], uninterrupted[n])]
        assert not differ, f"{what}: {differ} differ from the uninterrupted run"
    errors = results[0]["errors"]
    assert "KeyError" in errors["missing_layer"]
    assert "'model.blocks.4.lin.weight'" in errors["missing_layer"]
    assert "first missing key" in errors["missing_layer"]
    assert "'model.0.weight'" in errors["other_model"]
    assert "'blocks.4.lin.weight'" in errors["state_dict"]
