"""``pipetrain train --model-dir``: a tiny Llama folder fine-tuned on 2 gloo processes in
float64 equals the unsplit ``transformers`` model trained with the same AdamW on the same packed
batches (losses and the exported folder; 1F1B, ZBV and DualPipeV, with ``--tp 2`` and ``--dp
2`` too), ``--resume`` continues bit for
bit, GPT-2 with tied embeddings too, and bad input is one line with exit 2 before any process starts."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from finetune_cases import finetune_runs, write_folder
from runtime_harness import launch


@pytest.mark.slow
def test_folders_fine_tune_as_the_unsplit_model_resume_and_export(tmp_path):
    """A Llama folder under 1f1b (and with --tp 2) and a GPT-2 folder with tied embeddings under
    zbv."""
    folders = {
        "1f1b": write_folder(tmp_path / "llama", "llama"),
        "zbv": write_folder(tmp_path / "gpt2-tied", "gpt2-tied"),
    }
    results = launch(2, finetune_runs, str(tmp_path), folders, timeout=240)
    for schedule in folders:
        lead = results[0][schedule]
        assert lead["straight"] == pytest.approx(lead["reference"], rel=1e-12, abs=0), schedule
        assert lead["export_error"] < 1e-10, (schedule, lead["export_error"])
        assert "exported to" in lead["report"]
        if schedule == "1f1b":  # tensor parallel: the same sums in another order
            assert lead["tp"] == pytest.approx(lead["reference"], rel=1e-10, abs=0)
            assert lead["tp_export_error"] < 1e-8, lead["tp_export_error"]
            assert lead["dp"] == pytest.approx(lead["reference"], rel=1e-10, abs=0)
            assert lead["dualpipev"] == pytest.approx(lead["reference"], rel=1e-12, abs=0)
        for result in (r[schedule] for r in results):
            assert result["resumed"] == (2, result["straight"][2:])  # bit for bit
            assert result["differ"] == [], result["differ"]


def test_bad_folders_and_flags_are_refused_before_launching(tmp_path):
    """Each refused by the launcher's checks: what is missing or contradicts is named."""
    from finetune_cases import build, train_args

    from pipetrain.app.train_checks import check_arguments

    good = write_folder(tmp_path / "llama")
    bare = tmp_path / "bare"
    build("llama").save_pretrained(bare)  # no tokenizer
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("")
    corpus = ["--corpus-out", str(tmp_path / "corpus.txt")]
    cases = {
        (str(tmp_path / "none"),): "no such folder",
        (str(tmp_path),): "has no config.json",
        (str(full),): "has no config.json",
        (str(bare), "--seq-len", "16"): "has no tokenizer",
        (good, "--layers", "3"): "drop --layers",
        (good, "--model", "gpt", "--tie-embeddings"): "drop --model, --tie-embeddings",
        (good, "--seq-len", "64"): "max_position_embeddings 32",
        (good, "--seq-len", "16", "--export", str(full)): "is not empty",
        (good, "--seq-len", "16", "--export", good): "is the --model-dir folder",
        (good, "--seq-len", "16", "--tp", "3"): "--tp 3 must divide",
        (good, "--seq-len", "16", "--ranks", "6"): "use fewer stages",
    }
    for args, message in cases.items():
        with pytest.raises(ValueError, match=message):
            check_arguments(train_args("--model-dir", *args, *corpus))
    with pytest.raises(ValueError, match="needs --model-dir"):
        check_arguments(train_args("--export", str(tmp_path / "out")))
    from safetensors.torch import load_file, save_file

    partial = write_folder(tmp_path / "partial")
    weights = load_file(f"{partial}/model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, f"{partial}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor for 1 of .*'model.layers.1.mlp.down_proj"):
        check_arguments(train_args("--model-dir", partial, "--seq-len", "16", *corpus))
    (bare / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no safetensors files"):
        check_arguments(train_args("--model-dir", str(bare), "--seq-len", "16"))


def test_a_refusal_is_one_line_with_exit_2(tmp_path, capsys, monkeypatch):
    """``pipetrain train --model-dir`` in this process (the launcher refuses before any process
    starts; test_train.py and test_train_checks.py run such refusals as real processes too)."""
    from pipetrain.cli import main

    monkeypatch.chdir(tmp_path)
    good = write_folder(tmp_path / "llama")
    capsys.readouterr()  # what writing the folder printed
    assert main(["train", "--model-dir", good, "--hidden", "32"]) == 2
    said = capsys.readouterr()
    assert said.err.strip().splitlines() == [
        f"pipetrain train: error: --model-dir {good} gives the model (its config.json): drop "
        "--hidden, the built-in model's flags"
    ]
    assert "launching" not in said.out
