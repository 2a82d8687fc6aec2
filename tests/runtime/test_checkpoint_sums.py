"""Checkpoints carry ``SHA256SUMS`` (``sha256sum -c`` checks them), a damaged one is refused naming
the file and the last good checkpoint, and a write that fails (a file-size limit: ``EFBIG``, as
a full disk gives ``ENOSPC``) leaves no ``.partial`` folder and raises the ``OSError`` on every
rank (``tests/support/files_cases.py``)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from runtime_harness import launch

import pipetrain
from pipetrain.runtime.checksums import SUMS


def _checkpoint(path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).double()
    pipetrain.save_checkpoint(path, model, files={"hf/config.json": b"{}\n"})
    return model


@pytest.mark.skipif(shutil.which("sha256sum") is None, reason="needs coreutils' sha256sum")
def test_sums_list_every_file_in_sha256sum_format(tmp_path: Path) -> None:
    path = tmp_path / "step"
    _checkpoint(path)
    listed = sorted(line.split("  ", 1)[1] for line in (path / SUMS).read_text().splitlines())
    on_disk = sorted(
        p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != SUMS
    )
    assert listed == on_disk and "hf/config.json" in listed
    subprocess.run(["sha256sum", "--quiet", "-c", SUMS], cwd=path, check=True)


def test_a_flipped_byte_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "step"
    model = _checkpoint(path)
    shard = next(path.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1  # same size: the structure checks cannot see it
    shard.write_bytes(bytes(data))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError, match=rf"checkpoint .*step is damaged: .*{shard.name} is damaged"
    ):
        pipetrain.load_checkpoint(path, model, verify=True)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    (path / SUMS).unlink()
    with pytest.raises(ValueError, match=f"has no {SUMS}"):
        pipetrain.load_checkpoint(path, model, verify=True)


@pytest.mark.slow
def test_damaged_resume_and_failed_writes_on_two_ranks(tmp_path: Path) -> None:
    ckpt, out = tmp_path / "ckpt", tmp_path / "exports" / "model"
    out.parent.mkdir()
    said = launch(2, _cases(), str(ckpt), str(out), timeout=120)
    for result in said:
        assert "__1_0.distcp is damaged" in result["resume"], result["resume"]
        assert (
            "the last complete checkpoint" in result["resume"] and "step-000001" in result["resume"]
        )
        code, where = result["full"]
        assert code == "EFBIG" and "step-000003.partial" in where, result["full"]
        assert not result["partial_left"] and not result["step3"]
    code, where = said[0]["export"]
    assert code == "EFBIG" and "model.partial" in where, said[0]["export"]
    assert said[0]["export_left"] == [], said[0]["export_left"]  # no folder, no .partial


def _cases():
    from files_cases import damaged_resume_and_full_disk

    return damaged_resume_and_full_disk
