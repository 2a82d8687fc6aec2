"""``DropoutKeys`` in one process: the key's parts each change the seed, a keyed forward leaves
the caller's stream as found, nothing is keyed where no dropout is active, recompute draws the
same masks, and what cannot be keyed is refused; ``use_deterministic_algorithms``."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetrain.runtime import deterministic
from pipetrain.runtime.dropout_rng import DropoutKeys, layer_seed


def test_every_part_of_the_key_changes_the_seed():
    base = (1, 2, 3, "layers.4")
    seeds = {
        layer_seed(*base),
        layer_seed(9, 2, 3, "layers.4"),
        layer_seed(1, 9, 3, "layers.4"),
        layer_seed(1, 2, 9, "layers.4"),
        layer_seed(1, 2, 3, "layers.5"),
        layer_seed(*base, tp_rank=0),
        layer_seed(*base, tp_rank=1),
    }
    assert len(seeds) == 7
    assert all(0 <= s < 2**63 for s in seeds)
    assert layer_seed(*base) == layer_seed(*base)


def _layers(p: float = 0.5) -> list[nn.Module]:
    return [nn.Sequential(nn.Linear(4, 4), nn.Dropout(p)) for _ in range(3)]


def _run(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def test_keyed_masks_depend_on_the_key_only_and_leave_the_stream_alone():
    layers, x = _layers(), torch.ones(8, 4)
    keys = DropoutKeys(7).attach(layers)
    torch.manual_seed(0)
    with keys.running(2):
        first = _run(layers, x)
    after = torch.rand(3)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), after)  # the caller's stream as found
    torch.manual_seed(123)  # another global state: the same masks
    with keys.running(2):
        assert torch.equal(_run(layers, x), first)
    with keys.running(3):
        assert not torch.equal(_run(layers, x), first)
    keys.step += 1
    with keys.running(2):
        assert not torch.equal(_run(layers, x), first)


def test_nothing_is_keyed_without_active_dropout_or_a_seed():
    x = torch.ones(8, 4)
    for layers, why in ((_layers(0.0), "p = 0"), (_layers(), "eval"), (_layers(), "no seed")):
        keys = DropoutKeys(None if why == "no seed" else 7).attach(layers)
        if why == "eval":
            for layer in layers:
                layer.eval()
        assert not keys.active(), why
        torch.manual_seed(0)
        with keys.running(0):
            drawn = torch.rand(2)  # the global stream, not a keyed one
        torch.manual_seed(0)
        assert torch.equal(drawn, torch.rand(2))
        _run(layers, x)


def test_a_checkpointed_layer_draws_its_forwards_masks_again():
    layers = _layers()
    keys = DropoutKeys(3).attach(layers)
    x = torch.randn(8, 4, requires_grad=True)
    grads = []
    for recompute in (False, True):
        for layer in layers:
            layer.zero_grad()
        with keys.running(0):
            h = x
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False) if recompute else layer(h)
            h.sum().backward()
        grads.append([p.grad.clone() for layer in layers for p in layer.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_what_cannot_be_keyed_is_refused():
    with pytest.raises(ValueError, match="3 names for 2 layers"):
        DropoutKeys(1).attach(_layers()[:2], names=["a", "b", "c"])
    keys = DropoutKeys(1).attach(_layers())
    with pytest.raises(ValueError, match="captured CUDA graph cannot"):
        keys.refuse_captured()
    DropoutKeys(1).attach(_layers(0.0)).refuse_captured()  # no dropout: nothing to refuse
    DropoutKeys(None).attach(_layers()).refuse_captured()  # unkeyed: torch's stream, as before


@pytest.fixture
def restored_determinism(monkeypatch):
    monkeypatch.delenv(deterministic.CUBLAS_WORKSPACE, raising=False)
    flags = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(flags[0])
    torch.backends.cudnn.benchmark = flags[1]
    torch.backends.cudnn.deterministic = False


def test_deterministic_mode_sets_the_kernels_and_cublas_workspace(restored_determinism):
    deterministic.use_deterministic_algorithms()
    assert torch.are_deterministic_algorithms_enabled()
    assert os.environ[deterministic.CUBLAS_WORKSPACE] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_deterministic_mode_refuses_after_cuda_started(restored_determinism, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="before CUDA initialises"):
        deterministic.use_deterministic_algorithms()
    monkeypatch.setenv(deterministic.CUBLAS_WORKSPACE, ":16:8")  # set by the user: kept
    deterministic.use_deterministic_algorithms()
    assert os.environ[deterministic.CUBLAS_WORKSPACE] == ":16:8"
