"""Per-rank runners for the keyed-dropout tests (inside processes ``runtime_harness`` spawns).

A float64 stack whose layers draw dropout three ways — an ``nn.Dropout`` module, a float passed
to ``F.dropout`` (the way attention passes ``dropout_p`` to its kernel) — trained by a pipeline
with ``seed=`` and compared with the same layers unsplit, run micro-batch by micro-batch under
``DropoutKeys`` with the same seed: the loss and every gradient, two steps (the step is part of
the key).
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH, ROWS, LAYERS, MICROBATCHES, SEED, STEPS = 6, 8, 4, 4, 1234, 2
P = 0.1


class Functional(nn.Module):
    """Dropout as a float handed to a function (``scaled_dot_product_attention``'s way)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.dropout = p
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return nn.functional.dropout(self.lin(h), self.dropout, self.training)


class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Functional(P)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.drop = nn.Dropout(P)

    def forward(self, h):
        return h + self.drop(self.out(torch.tanh(self.inner(h))))


def build_layers() -> list[nn.Module]:
    torch.manual_seed(5)
    return [Layer().double() for _ in range(LAYERS)]


def mse(y, t):
    return ((y - t) ** 2).mean()


def batch(step: int, rows: int = ROWS):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, WIDTH, dtype=torch.float64, generator=g)
    return x, torch.randn(rows, WIDTH, dtype=torch.float64, generator=g)


def reference(microbatches: int, rows: int = ROWS, build=build_layers) -> list[tuple[float, dict]]:
    """The layers unsplit under the same keys: per step, the loss and every gradient."""
    from pipetrain.runtime.dropout_rng import DropoutKeys

    layers = build()
    keys = DropoutKeys(SEED).attach(layers)
    out = []
    for step in range(STEPS):
        for layer in layers:
            layer.zero_grad()
        x, y = batch(step, rows)
        total = 0.0
        for j, (xj, yj) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches))):
            with keys.running(j):
                h = xj
                for layer in layers:
                    h = layer(h)
                loss = mse(h, yj) * (len(xj) / len(x))
            loss.backward()
            total += float(loss.detach())
        grads = {
            f"layers.{i}.{n}": p.grad.clone()
            for i, layer in enumerate(layers)
            for n, p in layer.named_parameters()
        }
        out.append((total, grads))
        keys.step += 1
    return out


#: (label, schedule, stages per rank, cut, recompute per stage)
PIPELINE_CASES = [
    ("1f1b", "1f1b", 1, [2, 2], None),
    ("1f1b other cut", "1f1b", 1, [1, 3], None),
    ("zbv", "zbv", 2, [1, 1, 1, 1], None),
    ("dualpipev", "dualpipev", 2, [1, 1, 1, 1], None),
    ("1f1b full recompute", "1f1b", 1, [2, 2], ["full", "selective"]),
    ("zbv whole-stage recompute", "zbv", 2, [1, 1, 1, 1], ["whole", "none", "whole", "full"]),
]


def _differences(label: str, got: list[tuple[float, dict]], want, exact: bool = True) -> list[str]:
    problems = []
    for step, ((loss, grads), (want_loss, want_grads)) in enumerate(zip(got, want)):
        if abs(loss - want_loss) > 1e-12 * abs(want_loss):
            problems.append(f"{label} step {step}: loss {loss!r} vs {want_loss!r}")
        for name, g in grads.items():
            d = float((g - want_grads[name]).abs().max())
            if d > 1e-12:
                problems.append(f"{label} step {step}: gradient {name} differs by {d:.3g}")
    return problems


def _named(pipe) -> list[tuple[str, torch.Tensor]]:
    """This rank's parameters by global name (``layers.<i>.…``)."""
    return [(n, p) for m in pipe.modules.values() for n, p in m.named_parameters()]


def _train(pipe, steps: int, rows: slice | None = None) -> list[tuple[float, dict]]:
    out = []
    for step in range(steps):
        for p in pipe.parameters():
            p.grad = None
        x, y = batch(step)
        if rows is not None:
            x, y = x[rows], y[rows]
        loss = pipe.step(x, y)
        grads = {n: p.grad.clone() for n, p in _named(pipe) if p.grad is not None}
        out.append((float(loss), grads))
    return out


def run_pipelines(rank: int, world: int) -> dict:
    """Every ``PIPELINE_CASES`` layout on 2 ranks against the unsplit reference, and a
    data-parallel pair of replicas (one stage each) against it over the whole batch."""
    from torch.distributed.device_mesh import init_device_mesh

    import pipetrain

    want = reference(MICROBATCHES)
    problems: list[str] = []
    losses: dict[str, list[float]] = {}
    for label, schedule, per_rank, cut, recompute in PIPELINE_CASES:
        stages = pipetrain.split(build_layers(), cut, recompute=recompute)
        pipe = pipetrain.Pipeline(
            stages, schedule, MICROBATCHES, mse, stages_per_rank=per_rank, seed=SEED
        )
        got = _train(pipe, STEPS)
        problems += _differences(label, got, want)
        losses[label] = [loss for loss, _ in got]
        pipe.close()
    for schedule, per_rank in (("1f1b", 1), ("zbv", 2)):  # unseeded: the schedule's order
        torch.manual_seed(0)
        stages = pipetrain.split(build_layers(), [2, 2] if per_rank == 1 else [1, 1, 1, 1])
        pipe = pipetrain.Pipeline(stages, schedule, MICROBATCHES, mse, stages_per_rank=per_rank)
        losses[f"unseeded {schedule}"] = [loss for loss, _ in _train(pipe, 1)]
        pipe.close()
    # data parallel: replica r's micro-batch j is the whole batch's r * M + j
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "pp"))
    pipe = pipetrain.Pipeline(
        pipetrain.split(build_layers(), [LAYERS]),
        "1f1b",
        MICROBATCHES // 2,
        mse,
        mesh=mesh,
        data_parallel="ddp",
        seed=SEED,
    )
    half = ROWS // 2
    got = _train(pipe, STEPS, slice(rank * half, (rank + 1) * half))
    problems += _differences("dp 2", got, want)
    pipe.close()
    return {"problems": problems, "losses": losses}


class Sharded(nn.Module):
    """Up colwise and down rowwise under tensor parallel; between them a dropout passed as a
    float (``attention_dropout``, as attention over sharded heads does), on the sharded part."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.attention_dropout = p
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.mask: torch.Tensor | None = None

    def forward(self, h):
        z = nn.functional.dropout(torch.tanh(self.up(h)), self.attention_dropout, self.training)
        self.mask = (z == 0).detach()
        return self.down(z)


class ShardedLayer(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.attn = Sharded(p)
        self.drop = nn.Dropout(P)  # on the replicated output of the rowwise projection

    def forward(self, h):
        return h + self.drop(self.attn(h))


def sharded_layers(p: float) -> list[nn.Module]:
    torch.manual_seed(6)
    return [ShardedLayer(p).double() for _ in range(2)]


def run_tensor_parallel(rank: int, world: int) -> dict:
    """Tensor parallel over 2 ranks (one pipeline rank): without a sharded dropout the run
    equals the unsplit model (the replicated dropout draws one mask on both tp ranks); with one,
    each tp rank draws its own mask on its shard while the replicated parameters' gradients
    stay equal on both ranks."""
    import functools

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import pipetrain

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "tp"))
    plan = {"attn.up": ColwiseParallel(), "attn.down": RowwiseParallel()}
    out: dict = {}
    for p in (0.0, 0.3):
        layers = sharded_layers(p)
        for layer in layers:
            parallelize_module(layer, mesh["tp"], plan)
        pipe = pipetrain.Pipeline(
            pipetrain.split(layers, [2]), "1f1b", MICROBATCHES, mse, mesh=mesh, seed=SEED
        )
        got = _train(pipe, STEPS)
        full = [(loss, {n: _full(g) for n, g in grads.items()}) for loss, grads in got]
        if p == 0.0:
            want = reference(MICROBATCHES, build=functools.partial(sharded_layers, p))
            out["problems"] = _differences("tp 2", full, want)
            pipe.close()
            continue
        replicated = {
            n: g.to_local() for n, g in got[-1][1].items() if not _sharded(g)
        }  # the last step's: the same on both tp ranks, or the ranks diverged
        gathered: list = [None, None]
        dist.all_gather_object(gathered, (replicated, [layer.attn.mask for layer in layers]))
        out["replicated equal"] = all(
            torch.equal(gathered[0][0][n], gathered[1][0][n]) for n in replicated
        ) and bool(replicated)
        out["shard masks differ"] = all(
            not torch.equal(a, b) for a, b in zip(gathered[0][1], gathered[1][1])
        )
        out["dropped"] = sum(int(m.sum()) for m in gathered[rank][1])
        pipe.close()
    return out


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sharded(t) -> bool:
    return any(pl.is_shard() for pl in getattr(t, "placements", ()))
