"""A plan's per-stage recompute in the runtime: each stage's layers run under non-reentrant
checkpoints (full or selective), the loss and every gradient as without recompute, under 1F1B
and under zbv with either weight-gradient split (selective on blocks under graph replay too, which
runs a recomputing stage's backward whole), parameters and state-dict keys untouched (float64,
gloo, 2 ranks, one launch); and the plans the runtime refuses, on every rank alike."""

from __future__ import annotations

import pytest
import torch
from recompute_cases import PLANS, WHOLE_PLANS, run_recompute_plans, run_whole_stage_plans
from runtime_harness import launch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from pipetrain.planner.recompute_modes import stage_recompute
from pipetrain.runtime.backward.activation_checkpoint import (
    Recomputed,
    recompute_layers,
    recompute_stage,
)
from pipetrain.runtime.layers import split


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, run_recompute_plans, timeout=300)


@pytest.mark.slow
def test_recomputing_stages_train_exactly_as_without(two_ranks):
    for r in two_ranks:
        assert r["differences"], "no plan ran"
        for key, difference in r["differences"].items():
            assert difference < 1e-12, (key, difference)
        assert all(r["same_keys"].values()), r["same_keys"]
    for key, wrapped in two_ranks[0]["recomputed"].items():
        modes = next(p[5] for p in PLANS if key.endswith(p[0]))
        last = len(modes) - 1
        for s, mode in enumerate(modes):
            expected = [m.value for m in stage_recompute(mode).layer_modes(len(wrapped[s]))]
            if s == last and expected[-1] == "selective":
                expected[-1] = "none"  # the layer that feeds the loss: nothing to spare there
            assert wrapped[s] == expected, (key, s)


@pytest.mark.slow
def test_plans_the_runtime_cannot_run_are_refused_on_every_rank(two_ranks):
    r0, r1 = (r["refusals"] for r in two_ranks)
    assert r0 == r1
    assert (
        "stage 1 (layers act) recomputes 'full', but none of its layers holds parameters"
        in (r0["no parameters"])
    )
    # 1F1B on 2 ranks: the last stage's backward directly follows its forward
    assert "nothing to offload there" in r0["offload"]
    assert "unknown recompute mode 'everything'; legal: 'none', 'selective', 'full'" in r0["mode"]


def test_recompute_keeps_the_layers_names_and_parameters() -> None:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)) for _ in range(3)]
    stages = split(layers, [2, 1])
    before = {n: p for n, p in stages[0].named_parameters()}
    stage = recompute_stage(stages[0], "selective", 0)
    assert stage is stages[0] and dict(stage.named_parameters()) == before
    assert all(isinstance(layer, Recomputed) for layer, _ in stage.chain)
    assert recompute_stage(stage, "selective", 0) is stage  # the same mode again: no change
    with pytest.raises(ValueError, match="already recomputes 'selective'"):
        recompute_stage(stage, "full", 0)
    stage.eval()
    assert not any(m.training for m in layers[0].modules())
    with torch.no_grad():  # without autograd the layers run plainly
        assert stage(torch.ones(2, 4)).shape == (2, 4)


def test_selective_recompute_leaves_the_layer_that_feeds_the_loss_plain() -> None:
    """The last stage's last layer feeds the loss: what selective recompute would cache there
    is its output, which the loss keeps anyway, so it runs plainly; full recompute still wraps
    it (its inner tensors are spared), and every other stage wraps every layer."""
    from pipetrain.runtime.backward.activation_checkpoint import recompute_stages

    def modes(stage) -> list[str]:
        return [getattr(layer, "mode", "none") for layer, _ in stage.chain]

    layers = [nn.Linear(4, 4) for _ in range(5)]
    first, last = recompute_stages(split(layers, [2, 3]), ["selective", "selective"])
    assert modes(first) == ["selective"] * 2
    assert modes(last) == ["selective", "selective", "none"]
    layers = [nn.Linear(4, 4) for _ in range(5)]
    _, last = recompute_stages(split(layers, [2, 3]), ["none", "full"])
    assert modes(last) == ["full"] * 3
    alone = recompute_stages(split([nn.Linear(4, 4)], [1]), ["selective"])[0]
    assert modes(alone) == ["none"]  # one stage is also the last


def test_a_stage_recomputes_its_first_k_layers() -> None:
    """``"full:K"``: the stage's first K layers recompute, the rest run plainly; K above the
    stage's layer count is refused, naming both."""
    from pipetrain.runtime.backward.activation_checkpoint import recompute_stages

    def modes(stage) -> list[str]:
        return [getattr(layer, "mode", "none") for layer, _ in stage.chain]

    layers = [nn.Linear(4, 4) for _ in range(6)]
    first, last = recompute_stages(split(layers, [3, 3]), ["full:2", "selective:3"])
    assert modes(first) == ["full", "full", "none"]
    assert modes(last) == ["selective", "selective", "none"]  # the loss's layer stays plain
    assert recompute_stage(first, "full:2", 0) is first  # the same again: no change
    with pytest.raises(ValueError, match="stage 1: recompute 'full:4' names 4 layers of a stage "
                       "that holds 3; K is from 1 to 3"):  # fmt: skip
        recompute_stage(split([nn.Linear(4, 4) for _ in range(3)], [3])[0], "full:4", 1)


def test_split_recomputes_as_a_plan_does() -> None:
    """``pipetrain.split(..., recompute=)``: the stages a plan's recompute would give, for a list
    of layers and for a layer factory (each stage wrapped when first built)."""

    def modes(stage) -> list[str]:
        return [getattr(layer, "mode", "none") for layer, _ in stage.chain]

    def make(i: int) -> nn.Module:
        return nn.Linear(4, 4)

    for layers in ([make(i) for i in range(6)], make):
        stages = split(layers, [3, 3], num_layers=6, recompute=["full:2", "selective"])
        assert modes(stages[0]) == ["full", "full", "none"]
        assert modes(stages[1]) == ["selective", "selective", "none"]  # the loss's layer plain
    with pytest.raises(ValueError, match="recompute gives 1 modes for 2 stages"):
        split([make(i) for i in range(6)], [3, 3], recompute=["full"])


def test_recompute_layers_wraps_the_named_layers_each_in_its_mode() -> None:
    layers = [nn.Sequential(nn.Linear(4, 4), nn.GELU()) for _ in range(3)]
    (stage,) = split(layers, [3])
    keys = list(stage.state_dict())
    recompute_layers(stage, {"layers.0": "full", "layers.2": "selective", "layers.1": "none"})
    assert [getattr(layer, "mode", None) for layer, _ in stage.chain] == ["full", None, "selective"]
    assert list(stage.state_dict()) == keys
    first = stage.chain[0][0]
    recompute_layers(stage, {"layers.0": "full"})  # the same mode again: no change
    assert stage.chain[0][0] is first
    with pytest.raises(ValueError, match="layer layers.2 already recomputes 'selective'"):
        recompute_layers(stage, {"layers.2": "full"})
    with pytest.raises(ValueError, match="holds no layer 'layers.7'; its layers: layers.0, "):
        recompute_layers(stage, {"layers.7": "full"})
    with pytest.raises(ValueError, match="unknown recompute mode 'half'; legal: 'none', "):
        recompute_layers(stage, {"layers.1": "half"})
    # the stage's other layers join in the stage's mode; a layer in another mode is refused
    with pytest.raises(ValueError, match="stage 0 already recomputes 'selective'"):
        recompute_stage(stage, "full", 0)


class Counting(nn.Module):
    """A layer that counts its forwards (the first, and each recompute)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.runs = nn.Linear(6, 12), nn.Linear(12, 6), 0

    def forward(self, x):
        self.runs += 1
        return x + self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_replay_recomputes_a_recomputed_stage_once_and_exactly(mode, caplog) -> None:
    """Under graph replay a stage whose layers recompute is not split: I recomputes each layer
    once and takes the weight gradients; W only passes them on (replaying W would recompute
    them again and hold I's recomputed tensors until W)."""
    from torch.autograd.graph import get_gradient_edge

    from pipetrain.runtime.backward.graph_replay import GraphReplay
    from pipetrain.runtime.backward.interface import choose_split

    torch.manual_seed(0)
    layers = [Counting().double() for _ in range(2)]
    reference = [Counting().double() for _ in range(2)]
    for mine, theirs in zip(layers, reference):
        theirs.load_state_dict(mine.state_dict())
    (stage,) = split(layers, [2])
    recompute_stage(stage, mode, 0)
    caplog.set_level("INFO", logger="pipetrain.runtime.backward.interface")
    replay = choose_split(stage, False, 0)
    assert isinstance(replay, GraphReplay) and replay.whole
    assert "recomputed layers: the whole backward runs in I" in caplog.text
    x0, g = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    xr = x0.clone().requires_grad_()
    reference[1](reference[0](xr)).backward(g)
    x = x0.clone().requires_grad_()
    out = replay.call(stage, (x,))
    params = list(stage.parameters())
    (dx,), work = replay.backward_input([get_gradient_edge(out)], [g], [x], params, True)
    replay.backward_weight(work)
    assert [layer.runs for layer in layers] == [2, 2]  # the forward, then one recompute
    assert torch.allclose(dx, xr.grad, rtol=1e-12, atol=0)
    for p, q in zip(stage.parameters(), (p for r in reference for p in r.parameters())):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0)


class ProductFlops(TorchDispatchMode):
    """Counts the matrix products' FLOPs that run under it (torch's ``FlopCounterMode`` also
    tracks modules with gradient hooks, which an ``autograd.grad`` on a leaf input refuses)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func in (aten.mm.default, aten.addmm.default):
            a, b = args[-2:]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_deferred_linears_recompute_no_more_products_than_nn_linear(mode) -> None:
    """A checkpoint's recompute stops once its region's last saved tensor is packed again
    (torch's early stop): under ``nn.Linear`` a recomputed layer skips its last linear's product.
    The deferred linear packs its input before its product, so it skips it too: a quiet ``B`` of
    a recomputing stage under deferral costs the products the unsplit model's own backward costs,
    with the same gradients."""
    from torch.autograd.graph import get_gradient_edge

    from pipetrain.runtime.backward.interface import choose_split

    torch.manual_seed(0)
    layers = [Counting().double() for _ in range(2)]
    reference = [Counting().double() for _ in range(2)]
    for mine, theirs in zip(layers, reference):
        theirs.load_state_dict(mine.state_dict())
    (stage,), (unsplit,) = split(layers, [2]), split(reference, [2])
    recompute_stage(stage, mode, 0)
    recompute_stage(unsplit, mode, 0)
    x0, g = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    xr = x0.clone().requires_grad_()
    out = unsplit(xr)
    with ProductFlops() as plain:
        out.backward(g)
    deferred = choose_split(stage, True, 0)
    x = x0.clone().requires_grad_()
    out = deferred.call(stage, (x,))
    params = list(stage.parameters())
    with ProductFlops() as split_flops:
        (dx,) = deferred.backward_full([get_gradient_edge(out)], [g], [x], params, False)
    assert split_flops.flops == plain.flops > 0
    assert torch.allclose(dx, xr.grad, rtol=1e-12, atol=0)
    for p, q in zip(stage.parameters(), unsplit.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0)


def test_a_recomputing_stage_defaults_to_graph_replay_unless_deferral_is_asked_for(caplog):
    """By default a stage whose layers recompute in an eager step is split by graph replay (its
    backward whole in I), with the reason logged; the same layers without recompute defer their
    linears, and ``defer_weight_grads=True`` defers a recomputing stage too, as does a step
    captured as a CUDA graph (no host time replayed; W keeps the weight GEMMs)."""
    from pipetrain.runtime.backward.deferred_wgrad import DeferredLinears
    from pipetrain.runtime.backward.graph_replay import GraphReplay
    from pipetrain.runtime.backward.interface import choose_split

    (plain,) = split([Counting().double() for _ in range(2)], [2])
    assert isinstance(choose_split(plain, None, 0), DeferredLinears)
    (stage,) = split([Counting().double() for _ in range(2)], [2])
    recompute_stage(stage, "full", 0)
    caplog.set_level("INFO", logger="pipetrain.runtime.backward.interface")
    chosen = choose_split(stage, None, 0)
    assert isinstance(chosen, GraphReplay) and chosen.whole
    assert "its layers recompute" in caplog.text and "defer_weight_grads=True" in caplog.text
    assert isinstance(choose_split(stage, True, 0), DeferredLinears)
    assert isinstance(choose_split(stage, None, 0, captured=True), DeferredLinears)
    assert "captured as a CUDA graph" in caplog.text
    # captured, a recomputing stage defers even where its linears hold few of its parameters
    # (an embedding's stage), but not where it has none
    (embedding_heavy,) = split([nn.Embedding(1000, 6).double(), Counting().double()], [2])
    recompute_stage(embedding_heavy, "full", 0)
    assert isinstance(choose_split(embedding_heavy, None, 0), GraphReplay)
    assert isinstance(choose_split(embedding_heavy, None, 0, captured=True), DeferredLinears)
    (no_linears,) = split([nn.Sequential(nn.LayerNorm(6), nn.Tanh()).double()], [1])
    recompute_stage(no_linears, "full", 0)
    assert isinstance(choose_split(no_linears, None, 0, captured=True), GraphReplay)


def test_a_stage_whose_backward_is_never_split_does_not_defer_unless_asked(caplog):
    """In an eager 1F1B-family step (only B) deferral would only fuse the accumulation, at a
    Python autograd function per linear: plain autograd by default; asked for, or captured (no
    host work replayed), it defers."""
    from pipetrain.runtime.backward.deferred_wgrad import DeferredLinears
    from pipetrain.runtime.backward.graph_replay import GraphReplay
    from pipetrain.runtime.backward.interface import choose_split

    (stage,) = split([Counting().double() for _ in range(2)], [2])
    caplog.set_level("INFO", logger="pipetrain.runtime.backward.interface")
    chosen = choose_split(stage, None, 0, splits_backward=False)
    assert isinstance(chosen, GraphReplay) and not chosen.whole
    assert "never splits the backward" in caplog.text
    assert isinstance(choose_split(stage, True, 0, splits_backward=False), DeferredLinears)
    captured = choose_split(stage, None, 0, captured=True, splits_backward=False)
    assert isinstance(captured, DeferredLinears)
    assert isinstance(choose_split(stage, None, 0, splits_backward=True), DeferredLinears)


def test_the_pipeline_defers_only_on_stages_its_schedule_splits():
    from pipetrain.runtime import resolve
    from pipetrain.schedule.registry import build_schedule

    assert resolve.split_backward_stages(build_schedule("1f1b", 2, 4).actions[0]) == set()
    assert resolve.split_backward_stages(build_schedule("zbv", 2, 4).actions[0]) == {0, 3}


DROPPED = r"""
import gc, sys, weakref, torch, torch.distributed as dist
from torch import nn
import pipetrain
from pipetrain.runtime.backward.activation_checkpoint import recompute_stage
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
gc.disable()
assert "torch._dynamo" not in sys.modules, "imported already: nothing to test"
torch.manual_seed(0)
stages = pipetrain.split([nn.Linear(4, 4) for _ in range(4)], [2, 2])
for i, stage in enumerate(stages):
    recompute_stage(stage, "full", i)
pipe = pipetrain.Pipeline(stages, "interleaved-1f1b", 2, nn.functional.mse_loss)
pipe.step(torch.randn(4, 4), torch.randn(4, 4))
dropped = weakref.ref(pipe)
del pipe
print("freed" if dropped() is None else "still alive")
dist.destroy_process_group()
"""


def test_a_dropped_recomputing_pipeline_is_freed_without_the_garbage_collector(tmp_path) -> None:
    """The first checkpoint of a process imports ``torch._dynamo``, one of whose modules leaves
    a self-referencing frame: imported inside a step, its callers' frames kept the pipeline alive
    until the garbage collector ran (``activation_checkpoint.import_apart``). A fresh interpreter
    (dynamo not imported yet), the collector off."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", DROPPED, str(tmp_path / "rendezvous")],
        capture_output=True, text=True, timeout=120, cwd=root, check=False,
        env={**__import__("os").environ, "PYTHONPATH": str(root)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "freed"


@pytest.mark.slow
def test_stages_recomputed_as_a_whole_train_exactly_as_without() -> None:
    """``recompute_stage(stage, "whole")``: ``F`` without autograd, the forward again at ``I``
    or ``B``; the loss and every gradient as without recompute under 1F1B, zbv with either
    split and interleaved ZB (float64), a dropout stack's masks drawn again as they were."""
    results = launch(2, run_whole_stage_plans, timeout=300)
    for r in results:
        assert len(r["differences"]) >= len(WHOLE_PLANS) + 1
        for key, difference in r["differences"].items():
            assert difference < 1e-12, (key, difference)
    refusals = results[0]["refusals"]
    assert "none of its layers holds parameters" in refusals["no parameters"]
    assert "already recomputes 'full'; it cannot also recompute as a whole" in refusals["twice"]
