"""Deferred weight gradients in one process: I then W equals one backward, I leaves the linear
layers' weight GEMMs to W, the graph is freed after I, hooks fire once on the last piece, a quiet B
adds into ``.grad`` directly, autocast works, and which stages defer by default."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import pytest
import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from pipetrain.runtime.backward.deferred_wgrad import DeferredLinears, worth_deferring


class Net(nn.Module):
    """LayerNorm + embedding (finished in I), a linear used twice, a weight also used outside its
    linear, a frozen bias, and an ``nn.Linear`` subclass that must be left alone."""

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 0.5

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(4)
        self.emb = nn.Embedding(5, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)
        self.c = Net.Scaled(3, 3)
        self.b.bias.requires_grad_(False)

    def forward(self, x, ids, keep=None):
        h = self.ln(x) + self.emb(ids)
        t = torch.tanh(self.a(h))
        if keep is not None:
            keep.append(weakref.ref(t))  # saved by tanh's backward only
        h = self.a(t * 2.0)
        return self.c(self.b(h) + h[..., :3] * self.b.weight[0, :3])


def setup():
    torch.manual_seed(0)
    net = Net().double()
    ref = copy.deepcopy(net)
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3))
    g = torch.randn(2, 3, 3, dtype=torch.float64)
    xr = x.detach().requires_grad_()
    ref(xr, ids).backward(g)
    return net, ref, x, ids, g, xr.grad


def test_defers_plain_linears_only_and_never_changes_the_module():
    net = Net()
    before = {k: v.data_ptr() for k, v in net.state_dict().items()}
    split = DeferredLinears(net)
    assert split.linears == [net.a, net.b]  # c is an nn.Linear subclass: left alone
    with split.deferring():
        assert "forward" in net.a.__dict__ and "forward" not in net.c.__dict__
        assert type(net.a) is nn.Linear
    assert all("forward" not in m.__dict__ for m in net.modules())
    with pytest.raises(RuntimeError, match="boom"), split.deferring():
        raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in net.modules()), "undone on an error too"
    assert {k: v.data_ptr() for k, v in net.state_dict().items()} == before


def test_outside_input_gradient_phase_it_is_nn_linear():
    net, ref, x, ids, g, _ = setup()
    with DeferredLinears(net).deferring():
        out = net(x, ids)
    out.backward(g)
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0), n


def test_input_then_weight_equals_full_backward_and_frees_the_graph():
    net, ref, x, ids, g, dx_ref = setup()
    split = DeferredLinears(net)
    fired: dict[str, int] = {}
    for n, p in net.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda p, n=n: fired.__setitem__(n, fired.get(n, 0) + 1)
            )
    params = [p for p in net.parameters() if p.requires_grad]
    keep: list = []
    with split.deferring():
        out = net(x, ids, keep)
    (dx,), work = split.backward_input([get_gradient_edge(out)], [g], [x], params)
    del out
    gc.collect()
    assert keep[0]() is None, "I must free the graph: W needs only the stashed X and dY"
    assert torch.allclose(dx, dx_ref, rtol=1e-12, atol=0)
    assert net.a.weight.grad is None and net.a.bias.grad is None, "a's GEMMs belong to W"
    assert net.ln.weight.grad is not None and net.emb.weight.grad is not None
    assert net.b.weight.grad is not None, "b.weight's use outside its linear is finished in I"
    assert len(work.entries) == 3 and not work.held  # a twice, b once (c is not deferred)
    split.backward_weight(work, hooks=False)
    assert not fired, "quiet pieces run no AccumulateGrad hooks"
    assert all(p.grad is None or p.grad.grad_fn is None for p in params), (
        "W recorded autograd history into .grad (it would hold every stashed tensor)"
    )
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, n
        else:
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0), n


def test_last_piece_holds_its_gradients_for_one_pass_through_accumulate_grad():
    net, ref, x, ids, g, _ = setup()
    split = DeferredLinears(net)
    seen: dict[str, torch.Tensor] = {}
    for n, p in net.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p, n=n: seen.__setitem__(n, p.grad.clone()))
    params = [p for p in net.parameters() if p.requires_grad]
    for hold in (False, True):  # two micro-batches: the second is the step's last weight piece
        out = split.call(net, (x, ids))
        _, work = split.backward_input([get_gradient_edge(out)], [g * 0.5], [x], params, hold)
        if hold:  # what I computed stays out of .grad until W passes it to AccumulateGrad
            names = {id(p): n for n, p in net.named_parameters()}
            held = sorted(names[id(p)] for p, _ in work.held)
            assert held == ["b.weight", "c.bias", "c.weight", "emb.weight", "ln.bias", "ln.weight"]
        split.backward_weight(work, hooks=hold)
    assert all(p.grad.grad_fn is None and not p.grad.requires_grad for p in params)
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert set(seen) == trainable, "every trainable parameter's hook fired on the last piece"
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        if q.grad is not None:
            assert torch.equal(seen[n], p.grad), f"{n}: the hook saw a partial gradient"
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0), n


def test_quiet_full_backward_adds_weight_gradients_straight_into_grad():
    net, ref, x, ids, g, dx_ref = setup()
    ref(x.detach().requires_grad_(), ids).backward(g)  # the reference accumulates two passes
    split = DeferredLinears(net)
    params = [p for p in net.parameters() if p.requires_grad]
    for _ in range(2):
        out = split.call(net, (x, ids))
        (dx,) = split.backward_full([get_gradient_edge(out)], [g], [x], params, hooks=False)
        assert torch.allclose(dx, dx_ref, rtol=1e-12, atol=0)
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, n
        else:
            assert p.grad.grad_fn is None, n
            assert torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0), n


@pytest.mark.parametrize("hooked", [False, True])
def test_under_autocast_it_casts_like_autocast_and_keeps_grad_dtypes(hooked):
    """Also under saved-tensor hooks (``hooked``), where each linear is two functions and the
    weight is cast again in the backward."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    ref = copy.deepcopy(net)
    split = DeferredLinears(net)
    x0 = torch.randn(3, 8)
    x, xr = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    g = torch.randn(3, 4, dtype=torch.bfloat16)
    hooks = (
        torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
        if hooked
        else contextlib.nullcontext()
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = ref(xr)
        with hooks:
            out = split.call(net, (x,))
    expected.backward(g)
    assert out.dtype == expected.dtype == torch.bfloat16 and torch.equal(out, expected)
    assert (out.grad_fn.name() == "_ProductBackward") is hooked
    params = list(net.parameters())
    (dx,), work = split.backward_input([get_gradient_edge(out)], [g], [x], params)
    split.backward_weight(work, hooks=False)
    assert dx.dtype == torch.float32 and torch.allclose(dx, xr.grad, rtol=1e-2, atol=1e-3)
    for (n, p), q in zip(net.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32, n
        assert torch.allclose(p.grad, q.grad, rtol=1e-2, atol=1e-3), n


def test_stages_mostly_made_of_linears_are_worth_deferring():
    from pipetrain.app.models.gpt import GPTConfig, make_stage

    cfg = GPTConfig(num_layers=4, hidden=32, num_heads=4)
    assert all(worth_deferring(make_stage(cfg, s, 4)) for s in range(4))
    assert not worth_deferring(Net())  # 32 of 72 trainable elements in plain linears
    conv = nn.Sequential(nn.Conv2d(3, 64, 3), nn.Flatten(), nn.Linear(4, 2))
    assert not worth_deferring(conv)
    assert not worth_deferring(nn.Sequential(nn.Tanh()))  # nothing to train
    frozen = nn.Sequential(nn.Linear(64, 64), nn.Embedding(100, 8))
    assert worth_deferring(frozen)
    frozen[0].requires_grad_(False)
    assert not worth_deferring(frozen)


def test_the_stage_option_decides_and_the_module_stays_as_it_was():
    from pipetrain.runtime.backward.graph_replay import GraphReplay
    from pipetrain.runtime.stage import StageRunner

    net = Net()
    deferring = StageRunner(0, net, False, None, defer_weight_grads=True)
    assert isinstance(deferring.split, DeferredLinears) and deferring.defer_weight_grads
    replaying = StageRunner(0, net, False, None, defer_weight_grads=False)
    assert isinstance(replaying.split, GraphReplay) and not replaying.defer_weight_grads
    assert [type(m) for m in (net.a, net.b, net.c)] == [nn.Linear, nn.Linear, Net.Scaled]
    assert all("forward" not in m.__dict__ for m in net.modules())
