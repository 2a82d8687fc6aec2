"""``pipetrain train --model-dir``: a tiny Llama folder fine-tuned on 2 gloo processes in
float64 equals the unsplit ``transformers`` model trained with the same AdamW on the same padded
batches (losses and the exported folder), ``--resume`` continues bit for bit, GPT-2 with tied
embeddings too, and bad input is one line with exit 2 before any process starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from finetune_cases import finetune_runs, write_folder
from runtime_harness import launch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("kind,schedule", [("llama", "1f1b"), ("gpt2-tied", "zbv")])
def test_a_folder_fine_tunes_as_the_unsplit_model_resumes_and_exports(tmp_path, kind, schedule):
    folder = write_folder(tmp_path / kind, kind)
    results = launch(2, finetune_runs, str(tmp_path), folder, schedule, timeout=240)
    lead = results[0]
    assert lead["straight"] == pytest.approx(lead["reference"], rel=1e-12, abs=0)
    assert lead["export_error"] < 1e-10, lead["export_error"]
    assert "exported to" in lead["report"]
    for result in results:
        assert result["resumed"] == (2, result["straight"][2:])  # bit for bit after the resume
        assert result["differ"] == [], result["differ"]


def _train(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "pipetrain", "train", *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_bad_folders_and_flags_are_one_line_with_exit_2(tmp_path):
    """Each refused before a process starts: what is missing or contradicts is named."""
    from finetune_cases import build

    good = write_folder(tmp_path / "llama")
    bare = tmp_path / "bare"
    build("llama").save_pretrained(bare)  # no tokenizer
    weights = tmp_path / "weights"
    build("llama").save_pretrained(weights, safe_serialization=False)
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    cases = {
        (str(tmp_path / "none"),): "no such folder",
        (str(tmp_path),): "has no config.json",
        (str(bare), "--seq-len", "16"): "has no tokenizer",
        (good, "--layers", "3"): "drop --layers",
        (good, "--seq-len", "64"): "max_position_embeddings 32",
        (good, "--seq-len", "16", "--export", str(full)): "is not empty",
        (good, "--seq-len", "16", "--export", good): "is the --model-dir folder",
        (good, "--seq-len", "16", "--tp", "3"): "--tp 3 must divide",
    }
    if not any(weights.glob("*.safetensors")):
        cases[(str(weights),)] = "has no safetensors files"
    for args, message in cases.items():
        done = _train("--model-dir", *args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "launching" not in done.stdout
    done = _train("--export", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 2 and "needs --model-dir" in done.stderr
