"""The README's code runs as written: its training job (FSDP2 on a (dp, pp) mesh of 2 × 2, the
token-mean loss, clipping, a checkpoint) on 4 gloo processes in float32 and bfloat16, the
precisions people train in, not only float64; its planning block in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from readme_cases import code_block, run_training_job
from runtime_harness import launch


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_readme_training_job_runs(tmp_path: Path, dtype: str) -> None:
    results = launch(4, run_training_job, dtype, str(tmp_path), timeout=240)
    losses = {r["loss"] for r in results}
    assert len(losses) == 1 and all(0 < x < 100 for x in losses), results
    assert all(r["dtype"] == f"torch.{dtype}" for r in results), results
    assert all(r["saved"] for r in results) and (tmp_path / "ckpt" / "100" / ".metadata").is_file()


def test_the_readme_planning_block_runs() -> None:
    scope: dict = {}
    exec(code_block("README.md", "### Planning only (no torch needed)"), scope)
    assert scope["timeline"].makespan > 0
