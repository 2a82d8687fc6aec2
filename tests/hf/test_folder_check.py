"""A damaged ``--model-dir`` is one line naming the file (exit 2) before any worker starts: a
truncated single file, a missing or truncated shard, a bad index, a tensor of another shape than
config.json's, a header that is not one (``pipetrain.hf.folder_check``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from finetune_cases import build, tokenizer, write_folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("folders")
    single = Path(write_folder(root / "single"))
    sharded = root / "sharded"
    build("llama").save_pretrained(sharded, max_shard_size="20KB")
    tokenizer().save_pretrained(sharded)
    assert len(list(sharded.glob("*.safetensors"))) == 3

    def copy(source: Path, name: str) -> Path:
        return Path(shutil.copytree(source, root / name))

    out = {}
    out["truncated"] = copy(single, "truncated")
    _truncate(out["truncated"] / "model.safetensors", 1000)
    out["missing shard"] = copy(sharded, "missing")
    (out["missing shard"] / "model-00002-of-00003.safetensors").unlink()
    out["truncated shard"] = copy(sharded, "truncshard")
    _truncate(out["truncated shard"] / "model-00002-of-00003.safetensors", 8)
    out["bad index"] = copy(sharded, "badindex")
    (out["bad index"] / "model.safetensors.index.json").write_text('{"weight_map": ')
    out["wrong shape"] = copy(single, "shape")
    config = out["wrong shape"] / "config.json"
    config.write_text(
        config.read_text().replace('"intermediate_size": 24', '"intermediate_size": 32')
    )
    out["not safetensors"] = copy(single, "garbage")
    with (out["not safetensors"] / "model.safetensors").open("r+b") as f:
        f.write(b"garbage!")
    return out


def _truncate(path: Path, by: int) -> None:
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size - by)


EXPECTED = {
    "truncated": r"single/?.*model\.safetensors is truncated: \d+ bytes, its header's tensors need \d+; re-download this file",
    "missing shard": r"names 'model-00002-of-00003\.safetensors', which .* lacks; download it",
    "truncated shard": r"model-00002-of-00003\.safetensors is truncated: .*; re-download this file",
    "bad index": r"model\.safetensors\.index\.json cannot be read .*; re-download this file",
    "wrong shape": r"holds 'model\.layers\.0\.mlp\.gate_proj\.weight' of shape \(24, 16\), but config\.json describes \(32, 16\)",
    "not safetensors": r"model\.safetensors is truncated or not a safetensors file: .*re-download this file",
}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_a_damaged_folder_is_one_line_before_any_worker(case, folders, monkeypatch, capsys) -> None:
    import re

    from pipetrain.app import launch
    from pipetrain.cli.commands import main

    def started(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(launch, "start_processes", started)
    argv = ["train", "--model-dir", str(folders[case]), "--seq-len", "16", "--steps", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    pattern = EXPECTED[case].replace("single/?", "")
    assert re.search(pattern, err), err


def test_from_pretrained_refuses_alike(folders) -> None:
    import pipetrain.hf

    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors is truncated"):
        pipetrain.hf.from_pretrained(folders["truncated shard"], [2, 1, 2])
