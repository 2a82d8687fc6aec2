"""The documentation's code runs as written, on gloo in float32 and bfloat16 (the precisions
people train in, not only float64): the README's first training block (2 processes that
initialise their own group, as under torchrun), its training job (FSDP2 on a (dp, pp) mesh of
2 × 2, the token-mean loss, clipping, a checkpoint; 4 processes) and docs/training.md's first
block (split, side inputs, the token-mean loss, clipping, a checkpoint; 2 processes); and the
README's planning block, in this process. What a block leaves to the reader (a model, a batch) is
made by ``tests/support/readme_cases.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from readme_cases import (
    code_block,
    run_api_block,
    run_training_guide_block,
    run_training_job,
)
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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_readme_api_block_runs(dtype: str) -> None:
    for code, said in run_api_block(dtype):
        assert code == 0, said
        assert 0 <= float(said.strip().splitlines()[-1]) < 1, said  # the bubble fraction


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_training_guide_block_runs(tmp_path: Path, dtype: str) -> None:
    results = launch(2, run_training_guide_block, dtype, str(tmp_path), timeout=180)
    assert len({r["loss"] for r in results}) == 1 and 0 < results[0]["loss"] < 100, results
    assert all(r["saved"] for r in results)


def test_the_planning_guide_block_runs(tmp_path: Path, monkeypatch) -> None:
    """docs/planning.md's first block: profile four small layers, plan them for 4 ranks; the plan
    also comes from the costs file's path and from its JSON (``pipetrain.plan`` takes all
    three)."""
    import json

    import torch
    from torch import nn

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {
        "layers": [nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(4)],
        "sample_microbatch": torch.randn(4, 16),
        "loss": nn.functional.mse_loss,
        "targets": torch.randn(4, 16),
    }
    exec(code_block("docs/planning.md", "# Planning from measured costs"), scope)
    import pipetrain

    plan = scope["plan"]
    assert sum(plan.stage_layers) == 4
    again = pipetrain.plan("costs.json", num_ranks=4, memory_gib=40)
    from_json = pipetrain.plan(
        json.loads(Path("costs.json").read_text()), num_ranks=4, memory_gib=40
    )
    assert again.layout == from_json.layout


def test_the_fine_tuning_commands_are_train_flags() -> None:
    """docs/train-command.md's fine-tuning commands parse as ``pipetrain train`` flags (running them
    needs a released model; ``tests/app/test_finetune.py`` runs the same flags on a tiny one)."""
    import shlex

    from pipetrain.cli.train_command import config_from_argv

    block = code_block("docs/train-command.md", "## Fine-tuning a Hugging Face folder", "bash")
    commands = block.replace("\\\n", " ").strip().splitlines()
    assert len(commands) == 2
    for command in commands:
        words = shlex.split(command)
        assert words[:2] == ["pipetrain", "train"], command
        config = config_from_argv(words[2:])
        assert config.model_dir == "Llama-3.2-1B" and config.export == "Llama-3.2-1B-tuned"
    assert config.resume and config.overwrite_export
