"""``pipetrain export`` and ``pipetrain verify`` on a real run: a ``--model-dir`` run trained 2
steps with checkpoints, its folder deleted, exports from its checkpoint the weights its own
``--export`` wrote; ``verify`` passes every folder it wrote and names a damaged file (exit 1),
and ``export`` then names the last good checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from files_cases import checkpointed_run
from finetune_cases import write_folder
from runtime_harness import launch

from pipetrain.cli.commands import main


@pytest.mark.slow
def test_export_from_a_checkpoint_equals_the_runs_export(tmp_path: Path, capsys) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(write_folder(tmp_path / "llama"))
    assert launch(2, checkpointed_run, str(tmp_path), str(folder), timeout=180) == [True, True]
    ckpt, exported, again = tmp_path / "ckpt", tmp_path / "exported", tmp_path / "again"
    shutil.rmtree(folder)  # the checkpoint alone exports
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(again)]) == 0
    assert "step-000002" in capsys.readouterr().out
    ours = AutoModelForCausalLM.from_pretrained(again, dtype=torch.float64).state_dict()
    theirs = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64).state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (again / "tokenizer.json").read_bytes() == (exported / "tokenizer.json").read_bytes()

    for target in (ckpt, exported, again):
        assert main(["verify", str(target)]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.count("OK ") == 4  # two steps, two model folders

    shard = ckpt / "step-000002" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert main(["verify", str(ckpt)]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED  {ckpt / 'step-000002'}" in out and f"{shard} is damaged" in out, out
    assert f"OK       {ckpt / 'step-000001'}" in out
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert f"{shard} is damaged" in err and f"export {ckpt / 'step-000001'} instead" in err, err
    assert not (tmp_path / "no").exists() or not any((tmp_path / "no").iterdir())
    assert main(["verify", str(tmp_path)]) == 2  # neither a checkpoint nor a model folder
