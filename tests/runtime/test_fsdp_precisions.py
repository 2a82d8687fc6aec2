"""FSDP2 under the pipeline on gloo in float32 and bfloat16, every loss reduction: it runs (gloo
has neither AVG nor PREMUL_SUM, which FSDP2 picks outside float64) and its loss and gradients
equal DDP's from the same weights to the precision's rounding. Exactness against the unsplit
model is tested in float64 (``test_dp_runtime.py``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from fsdp_precision_cases import run_fsdp_precisions
from runtime_harness import launch


@pytest.mark.slow
def test_fsdp2_runs_every_reduction_in_float32_and_bfloat16_like_ddp() -> None:
    results = launch(4, run_fsdp_precisions, timeout=240)
    for outcomes in results:
        assert len(outcomes) == 6
        for case, (fsdp_loss, ddp_loss, worst, tol, same_params) in outcomes.items():
            assert same_params, case
            assert abs(fsdp_loss - ddp_loss) <= tol * max(1.0, abs(ddp_loss)), case
            assert worst <= tol, (case, worst)
