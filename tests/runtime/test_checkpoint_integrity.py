"""Checkpoints are all or nothing: written under their name only once complete, and read only
after the folder, every key, shape and dtype were checked and every tensor was read. One process,
a plain module (DCP without a process group); the multi-process paths share every check
(``tests/runtime/test_training_runtime.py`` runs them on gloo)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.runtime.checkpoint_disk import PARTIAL


def model(depth: int = 3, dtype=torch.float32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(depth))).to(dtype)


def saved(tmp_path: Path, **kw) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    """A checkpoint of a 3-layer model after one AdamW step."""
    m = model(**kw)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 4, dtype=next(m.parameters()).dtype)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt"
    pipetrain.save_checkpoint(path, m, opt)
    return path, m, opt


def snapshot(m: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def unchanged(m: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.distcp"))


def test_a_checkpoint_appears_only_complete_and_replaces_a_stale_partial(tmp_path: Path) -> None:
    stale = tmp_path / f"ckpt{PARTIAL}"
    stale.mkdir()
    (stale / "junk").write_text("a writer killed earlier")
    path, _, _ = saved(tmp_path)
    assert (path / ".metadata").is_file() and shards(path)
    assert not stale.exists()
    other = model(seed=1)
    pipetrain.save_checkpoint(path, other, files={"note.txt": "hello"})  # replaces it whole
    assert (path / "note.txt").read_text() == "hello"
    fresh = model(seed=2)
    pipetrain.load_checkpoint(path, fresh)
    assert unchanged(fresh, snapshot(other))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("damage", ["truncated", "empty", "missing"])
def test_a_damaged_shard_is_refused_naming_it_before_anything_changes(
    tmp_path: Path, damage: str
) -> None:
    path, _, _ = saved(tmp_path)
    shard = shards(path)[0]
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "empty":
        shard.write_bytes(b"")
    else:
        shard.unlink()
    target = model(seed=5)
    opt = torch.optim.AdamW(target.parameters())
    before = snapshot(target)
    with pytest.raises(ValueError, match=rf"{shard.name}.*(truncated|missing)") as e:
        pipetrain.load_checkpoint(path, target, opt)
    assert "\n" not in str(e.value)
    assert unchanged(target, before) and not opt.state


def test_a_corrupt_metadata_file_is_refused_naming_it(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path)
    (path / ".metadata").write_bytes(b"")
    with pytest.raises(ValueError, match=r"\.metadata cannot be read \(EOFError"):
        pipetrain.load_checkpoint(path, model())
    (path / ".metadata").unlink()
    with pytest.raises(ValueError, match="incomplete: it has no .metadata"):
        pipetrain.load_checkpoint(path, model())


def test_a_deeper_models_checkpoint_is_refused_unless_not_strict(tmp_path: Path) -> None:
    path, deep, _ = saved(tmp_path)  # 3 layers
    shallow = model(depth=2, seed=7)
    before = snapshot(shallow)
    with pytest.raises(ValueError, match=r"holds '2.bias' and 1 more.*strict=False"):
        pipetrain.load_checkpoint(path, shallow)
    assert unchanged(shallow, before)
    pipetrain.load_checkpoint(path, shallow, strict=False)
    assert all(torch.equal(v, deep.state_dict()[k]) for k, v in shallow.state_dict().items())


def test_a_shallower_models_checkpoint_names_the_missing_key(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path, depth=2)
    deep = model(depth=3, seed=7)
    before = snapshot(deep)
    with pytest.raises(KeyError, match="'model.2.weight'"):
        pipetrain.load_checkpoint(path, deep)
    assert unchanged(deep, before)


def test_another_dtype_is_refused(tmp_path: Path) -> None:
    path, _, _ = saved(tmp_path, dtype=torch.float64)
    target = model(dtype=torch.float32)
    with pytest.raises(ValueError, match="float64 in the checkpoint but torch.float32"):
        pipetrain.load_checkpoint(path, target)


def test_a_good_checkpoint_loads_model_and_optimizer(tmp_path: Path) -> None:
    path, m, opt = saved(tmp_path)
    target = model(seed=3)
    target_opt = torch.optim.AdamW(target.parameters())
    pipetrain.load_checkpoint(path, target, target_opt)
    assert unchanged(target, snapshot(m))
    ours = target_opt.state_dict()["state"]
    theirs = opt.state_dict()["state"]
    assert all(torch.equal(ours[i]["exp_avg"], theirs[i]["exp_avg"]) for i in theirs)
