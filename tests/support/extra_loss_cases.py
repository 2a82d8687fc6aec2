"""Per-rank runners for ``test_extra_losses``: layers that record extra loss terms
(``runtime.extra_losses``), trained under pipeline schedules in float64 on gloo against the
unsplit model under gradient accumulation over the same micro-batches, each micro-batch adding
its terms divided by the number of micro-batches (over every replica's, with data parallel).

The model: ``LAYERS`` residual blocks that each record ``"aux" = coef · mean(h²)`` of their output
(a router's balancing loss stands in: a scalar of the micro-batch with a graph through the
block's weights and its input); the first two blocks also record ``"z"`` (a name the first stage
records alone), and ``LATE`` records ``"late"`` from the second step on (a name that joins after
the first step); block 3 adds a term of its weights alone to ``"aux"``; the last layer is a head
that records nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from pipetrain.runtime.extra_losses import record_extra_loss, take_extra_losses

WIDTH = 4
LAYERS = 7  # blocks; one head follows
COEF = 0.3
ROWS = 8  # per replica


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)  # not a linear: finished in I when linears defer
        self.index = index
        self.late = False  # set between steps

    def forward(self, h):
        out = torch.tanh(self.norm(self.a(h))) + h
        record_extra_loss(self, "aux", COEF * out.pow(2).mean())
        if self.index < 2:
            record_extra_loss(self, "z", 0.1 * torch.logsumexp(self.a(out), -1).pow(2).mean())
        if self.index == 3:  # a term of the weights alone (a root outside the input's path)
            record_extra_loss(self, "aux", 1e-2 * self.a.weight.pow(2).sum())
        if self.late:
            record_extra_loss(self, "late", 0.05 * out.sum().pow(2) / out.numel())
        return out


#: the block that records ``"late"`` from the second step on
LATE = 5


def build_layers() -> list[nn.Module]:
    torch.manual_seed(11)
    layers: list[nn.Module] = [Block(i) for i in range(LAYERS)]
    layers.append(nn.Linear(WIDTH, 2))
    return [m.double() for m in layers]


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def sum_loss(out, y):
    return nn.functional.mse_loss(out, y, reduction="sum")


def batch(replicas: int):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(ROWS * replicas, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(ROWS * replicas, 2, generator=g, dtype=torch.float64)
    return x, y


def reference(x, y, microbatches: int, reduction: str, steps: int):
    """The unsplit model, gradient accumulation over ``microbatches`` equal micro-batches of the
    global batch: ``Σ_j w_j · loss_j + (1/M) Σ_j Σ terms_j`` per step, terms read with
    ``take_extra_losses`` after each plain forward. Returns (loss, extra report, gradients) of
    the last step (gradients accumulated over ``steps``)."""
    layers = build_layers()
    rows = x.shape[0] // microbatches
    for step in range(steps):
        layers[LATE].late = step > 0
        loss = torch.zeros((), dtype=torch.float64)
        report: dict[str, float] = {}
        for j in range(microbatches):
            h = x[j * rows : (j + 1) * rows]
            for layer in layers:
                h = layer(h)
            terms = take_extra_losses(nn.ModuleList(layers))
            weight = 1.0 / microbatches if reduction == "mean" else 1.0
            main = (loss_fn if reduction == "mean" else sum_loss)(h, y[j * rows : (j + 1) * rows])
            total = weight * main + sum(terms.values()) / microbatches
            total.backward()
            loss = loss + weight * main.detach()
            for name, value in terms.items():
                report[name] = report.get(name, 0.0) + value.item() / microbatches
    grads = {(i, n): p.grad for i, m in enumerate(layers) for n, p in m.named_parameters()}
    return loss, report, grads


#: (label, schedule, stages per rank, stage_layers, recompute, defer_weight_grads)
CASES = [
    ("1f1b", "1f1b", 1, [4, 4], None, None),
    ("interleaved", "interleaved-1f1b", 2, [2, 2, 2, 2], None, None),
    ("zbv graph replay", "zbv", 2, [2, 2, 2, 2], None, False),
    ("zbv deferred", "zbv", 2, [2, 2, 2, 2], None, True),
    ("dualpipev", "dualpipev", 2, [2, 2, 2, 2], None, None),
    ("1f1b full recompute", "1f1b", 1, [4, 4], ["full", "selective"], None),
    ("zbv recompute deferred", "zbv", 2, [2, 2, 2, 2], ["full", "none", "full", "full"], True),
    ("zbv whole", "zbv", 2, [2, 2, 2, 2], ["whole", "none", "whole", "whole"], False),
    ("zbv whole deferred", "zbv", 2, [2, 2, 2, 2], ["whole", "whole", "none", "whole"], True),
]
MICROBATCHES = 4
STEPS = 2


def _close(a, b, rtol: float = 1e-10) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return bool((a - b).norm() <= rtol * b.norm() + 1e-14)


def _compare(case, pipe, layers, cut, loss, report, ref, failures: list[str]) -> None:
    ref_loss, ref_report, ref_grads = ref
    if not _close(loss, ref_loss):
        failures.append(f"{case}: loss {loss.item()} != {ref_loss.item()}")
    if pipe.extra_losses.keys() != ref_report.keys():
        failures.append(f"{case}: extra loss names {sorted(report)} != {sorted(ref_report)}")
    for name, value in ref_report.items():
        if not _close(report.get(name, float("nan")), value):
            failures.append(f"{case}: extra loss {name} {report.get(name)} != {value}")
    starts = [sum(cut[:s]) for s in range(len(cut))]
    for s in pipe.modules:
        for k in range(cut[s]):
            i = starts[s] + k
            for n, p in layers[i].named_parameters():
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                if not _close(g, ref_grads[(i, n)]):
                    failures.append(f"{case}: layer {i} {n} gradient differs")


def run_schedules(rank: int, world: int) -> dict:
    """Every ``CASES`` entry on 2 pipeline ranks: loss, extra-loss report and every gradient of
    this rank's layers after ``STEPS`` steps against ``reference``."""
    import pipetrain

    failures: list[str] = []
    reports: dict[str, dict[str, float]] = {}
    x, y = batch(1)
    ref = reference(x, y, MICROBATCHES, "mean", STEPS)
    for label, schedule, v, cut, recompute, defer in CASES:
        layers = build_layers()
        stages = pipetrain.split(layers, cut, recompute=recompute)
        with pipetrain.Pipeline(
            stages,
            schedule,
            MICROBATCHES,
            loss_fn,
            stages_per_rank=v,
            defer_weight_grads=defer,
        ) as pipe:
            for step in range(STEPS):
                layers[LATE].late = step > 0
                loss = pipe.step(x, y)
            reports[label] = dict(pipe.extra_losses)
            _compare(label, pipe, layers, cut, loss, pipe.extra_losses, ref, failures)
        # closed: the layers record for a plain forward again
        h = x[:2]
        for layer in layers:
            h = layer(h)
        if sorted(take_extra_losses(nn.ModuleList(layers))) != ["aux", "late", "z"]:
            failures.append(f"{label}: a closed pipeline's layers still send terms to it")
    return {"failures": failures, "reports": reports}


#: (label, data_parallel, loss reduction, schedule, defer_weight_grads)
DP_CASES = [
    ("ddp mean zbv", "ddp", "mean", "zbv", True),  # replicas average: each weighs 1/M
    ("fsdp sum dualpipev", "fsdp", "sum", "dualpipev", None),  # replicas sum: 1/(M·dp)
]


def run_data_parallel(rank: int, world: int) -> dict:
    """``DP_CASES`` on a ("dp", "pp") mesh of 2 × 2: each replica steps on its half of the
    global batch; the reference accumulates over both halves' micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh

    import pipetrain

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    failures: list[str] = []
    reports: dict[str, dict[str, float]] = {}
    x, y = batch(2)
    mine = slice(replica * ROWS, (replica + 1) * ROWS)
    for label, kind, reduction, schedule, defer in DP_CASES:
        v = 2 if schedule in ("zbv", "dualpipev") else 1
        cut = [2, 2, 2, 2] if v == 2 else [4, 4]
        layers = build_layers()
        with pipetrain.Pipeline(
            pipetrain.split(layers, cut),
            schedule,
            MICROBATCHES,
            loss_fn if reduction == "mean" else sum_loss,
            stages_per_rank=v,
            mesh=mesh,
            data_parallel=kind,
            loss_reduction=reduction,
            defer_weight_grads=defer,
        ) as pipe:
            for step in range(STEPS):
                layers[LATE].late = step > 0
                loss = pipe.step(x[mine], y[mine])
            ref = reference(x, y, 2 * MICROBATCHES, reduction, STEPS)
            reports[label] = dict(pipe.extra_losses)
            _compare(label, pipe, layers, cut, loss, pipe.extra_losses, ref, failures)
    return {"failures": failures, "reports": reports, "refusal": _replicas_differ(mesh, replica)}


def _replicas_differ(mesh, replica: int) -> str:
    """One replica's layers record a name the other's do not: refused on every rank."""
    import pipetrain

    layers = build_layers()
    layers[LATE].late = replica == 1
    x, y = batch(1)
    with pipetrain.Pipeline(
        pipetrain.split(layers, [4, 4]), "1f1b", 2, loss_fn, mesh=mesh, data_parallel="ddp"
    ) as pipe:
        try:
            pipe.step(x, y)
        except ValueError as e:
            return str(e)
    return "no error"
