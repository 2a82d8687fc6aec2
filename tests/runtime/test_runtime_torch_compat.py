"""The private torch interfaces the runtime relies on still behave as it expects.

A torch release that changes one fails here, naming the API, instead of deep inside a step."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipetrain.runtime import torch_compat

RUNTIME = Path(torch_compat.__file__).parent


def test_every_private_torch_api_still_works():
    broken = torch_compat.check_private_apis()
    assert not broken, "torch changed APIs pipetrain relies on:\n" + "\n".join(broken)


def test_a_changed_api_is_reported_by_name(monkeypatch):
    monkeypatch.setattr(torch_compat, "_engine_run_backward", None)
    broken = torch_compat.check_private_apis()
    assert len(broken) == 1 and "torch.autograd.graph._engine_run_backward" in broken[0]


def _private_torch_names(path: Path) -> list[str]:
    """``torch....._name`` attribute chains and ``from torch... import _name`` in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            found += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            if any(part.startswith("_") for part in (node.module or "").split(".")):
                found.append(node.module or "")
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__"):
                continue  # torch.__version__ and the like are public
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in ("torch", "dist", "c10d"):
                found.append(f"{base.id}...{node.attr}")
    return found


@pytest.mark.parametrize(
    "path", sorted(p for p in RUNTIME.rglob("*.py") if p.name != "torch_compat.py"), ids=str
)
def test_no_other_runtime_module_touches_private_torch_names(path):
    assert _private_torch_names(path) == []


def test_a_stager_that_closed_its_copier_is_not_reused():
    """torch 2.11's DefaultStager empties its deep-copier's table after each staging."""
    from types import SimpleNamespace

    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from pipetrain.runtime.checkpoint_async import _stager_reusable as stager_reusable

    stager = DefaultStager(StagingOptions(False, False, False, False))
    try:
        assert stager_reusable(stager)
        stager.stage({"w": torch.ones(3)})
        closed = SimpleNamespace(_state_dict_stager=SimpleNamespace(_deepcopy_dispatch={}))
        assert not stager_reusable(closed)
    finally:
        stager.close()


def test_the_stager_keeps_its_copies_from_one_save_to_the_next():
    """Where torch closes the stager's copier after each staging (2.11), the copies are still
    reused by the next save; closing the stager lets them go."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    from pipetrain.runtime.checkpoint_async import _close_stager, _keeping_copies, _stager_reusable

    stager = _keeping_copies(DefaultStager(StagingOptions(False, False, False, False)))
    inner = stager._state_dict_stager
    w = torch.ones(3)
    try:
        first = stager.stage({"w": w})["w"]
        inner.close()  # what torch 2.11's stager does after every staging
        assert _stager_reusable(stager)
        w.add_(1)
        second = stager.stage({"w": w})["w"]
        assert torch.equal(second, w) and not torch.equal(first, torch.ones(3))
        assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    finally:
        _close_stager(stager)
    assert len(inner._cached_storage_mapping) == 0 and not inner._deepcopy_dispatch
