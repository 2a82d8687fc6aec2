"""Per-rank runner for tied weights given as a stage list (inside processes ``runtime_harness``
spawns): one ``Parameter`` object in stages on different ranks, tied as if declared; frozen tied
parameters left out of the tied sum; a shared object whose name another stage reuses refused."""

from __future__ import annotations

import torch
from runtime_cases import _error_of
from torch import nn

VOCAB, WIDTH = 7, 5


class Embed(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.emb.weight = weight
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.lin(self.emb(x)))


class Head(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = weight

    def forward(self, h):
        return self.head(torch.sin(self.lin(h)))


def stages(frozen: bool = False) -> list[nn.Module]:
    torch.manual_seed(5)
    shared = nn.Parameter(torch.randn(VOCAB, WIDTH))
    shared.requires_grad_(not frozen)
    return [m.double() for m in (Embed(shared), Head(shared))]


def loss_fn(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def batch():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, VOCAB, (4, 3), generator=g), torch.randint(
        0, VOCAB, (4, 3), generator=g
    )


def _grads(modules) -> dict[str, torch.Tensor | None]:
    return {f"{i}.{n}": p.grad for i, m in modules for n, p in m.named_parameters()}


def run_tied_edges(rank: int, world: int) -> dict:
    import pipetrain

    out: dict = {"failures": []}
    x, y = batch()
    for frozen in (False, True):
        ref = stages(frozen)
        loss_fn(ref[1](ref[0](x)), y).backward()
        want = _grads(enumerate(ref))
        mine = stages(frozen)
        pipe = pipetrain.Pipeline(mine, "1f1b", 2, loss_fn, device="cpu")
        loss = pipe.step(x, y)
        expected = loss_fn(ref[1](ref[0](x)), y)
        if abs(float(loss) - float(expected)) > 1e-12:
            out["failures"].append(f"frozen={frozen}: loss {float(loss)} vs {float(expected)}")
        got = _grads(pipe.modules.items())
        for name, g in got.items():
            w = want[name]
            if (g is None) != (w is None) or (g is not None and float((g - w).abs().max()) > 1e-12):
                out["failures"].append(f"frozen={frozen}: gradient {name} differs")
        pipe.close()

    def reused_name():
        first, second = stages()
        second.lin.weight = nn.Parameter(second.lin.weight.detach().clone())
        second.head.weight = first.emb.weight
        first.register_parameter("head_weight_alias", None)
        other = nn.Linear(WIDTH, WIDTH).double()
        second.emb = nn.Module()
        second.emb.weight = other.weight  # the shared object's name 'emb.weight', another object
        return pipetrain.Pipeline([first, second], "1f1b", 2, loss_fn, device="cpu")

    out["reused_name"] = _error_of(reused_name)
    return out
