"""Per-rank runners for the tensor-parallel tests (inside processes ``runtime_harness`` spawns).

Every rank builds the same float64 token model (seeded): an embedding, MLP blocks with a
LayerNorm, a head. The blocks are parallelized with torch's own ``parallelize_module`` plans on
``mesh["tp"]`` (up colwise, down rowwise; with sequence parallel also the norms, the embedding
vocabulary-parallel and the head colwise from a sequence-sharded input), cut by
``pipetrain.split`` and run by ``Pipeline(mesh=...)``. Each case trains two steps (step, clip,
AdamW) and compares with the same model unsplit and unparallelized in one process: the losses,
every gradient (``full_tensor()``), the clipped norm and the parameters after the steps.
"""

from __future__ import annotations

import torch
from runtime_cases import _error_of
from torch import nn

WIDTH, VOCAB, SEQ, ROWS = 8, 11, 4, 8
IGNORE = -100
STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, h):
        return h + self.down(torch.tanh(self.up(self.norm(h))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB)

    def forward(self, h):
        return self.out(self.norm(h))


def build_layers(blocks: int) -> dict[str, nn.Module]:
    torch.manual_seed(3)
    layers: dict[str, nn.Module] = {"embed": nn.Embedding(VOCAB, WIDTH)}
    layers |= {f"blocks.{i}": Block() for i in range(blocks)}
    layers["head"] = Head()
    return {n: m.double() for n, m in layers.items()}


def token_sum(logits, y):
    return nn.functional.cross_entropy(
        logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def token_mean_unsplit(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)


def mean_loss(logits, y):
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def batch(seed: int = 0, padded: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    if padded:  # the last tokens of some rows are padding
        y[::3, -2:] = IGNORE
        y[1, -1] = IGNORE
    return x, y


def tp_plan(sequence_parallel: bool) -> tuple[dict, dict, dict]:
    """(block plan, embedding plan, head plan) in torch's ``parallelize_module`` styles."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if not sequence_parallel:
        return {"up": ColwiseParallel(), "down": RowwiseParallel()}, {}, {}
    block = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    embed = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    head = {
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    return block, {"": embed}, head


def parallelize(layers: dict[str, nn.Module], tp_mesh, sequence_parallel: bool) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    block, embed, head = tp_plan(sequence_parallel)
    for name, layer in layers.items():
        if name.startswith("blocks."):
            parallelize_module(layer, tp_mesh, block)
        elif name == "embed" and embed:
            parallelize_module(layer, tp_mesh, embed[""])
        elif name == "head" and head:
            parallelize_module(layer, tp_mesh, head)


def reference(blocks: int, loss_of, padded: bool, max_norm: float, steps: int = STEPS):
    """The unsplit model trained ``STEPS`` steps: losses, first-step gradients and norm, final
    parameters."""
    layers = build_layers(blocks)
    model = nn.Sequential(*layers.values())
    names = {id(p): f"{ln}.{pn}" for ln, m in layers.items() for pn, p in m.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    losses, grads, norms = [], {}, []
    for step in range(steps):
        x, y = batch(step, padded)
        loss = loss_of(model(x), y)
        loss.backward()
        if step == 0:
            grads = {names[id(p)]: p.grad.clone() for p in model.parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    params = {names[id(p)]: p.detach().clone() for p in model.parameters()}
    return losses, grads, norms, params


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _differ(a, b) -> float:
    return float((_full(a) - b).abs().max())


def run_case(mesh, case: dict, blocks: int) -> list[str]:
    """One case on this rank: a list of failures (empty when exact)."""
    import pipetrain

    counts = case["stage_layers"]
    layers = build_layers(blocks)
    if "tp" in mesh.mesh_dim_names:
        parallelize(layers, mesh["tp"], case.get("sequence_parallel", False))
    stages = pipetrain.split(layers, counts)
    padded = case.get("loss") == "token_mean"
    loss_fn, reduction, unsplit = (
        (token_sum, "token_mean", token_mean_unsplit) if padded else (mean_loss, "mean", mean_loss)
    )
    pipe = pipetrain.Pipeline(
        stages,
        case["schedule"],
        case.get("microbatches", 4),
        loss_fn,
        mesh=mesh,
        data_parallel=case.get("data_parallel"),
        loss_reduction=reduction,
        ignore_index=IGNORE if padded else None,
        defer_weight_grads=case.get("defer"),
        device="cpu",
    )
    max_norm = 0.05
    want_losses, want_grads, want_norms, want_params = reference(blocks, unsplit, padded, max_norm)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.05)
    failures = []
    label = f"{case}"
    dp, dp_size = 0, 1  # this replica's index and the replica count (HSDP: both dimensions)
    for name in ("dp", "dp_replicate", "dp_shard"):
        if name in mesh.mesh_dim_names:
            dp = dp * mesh.size(mesh.mesh_dim_names.index(name)) + mesh.get_local_rank(name)
            dp_size *= mesh.size(mesh.mesh_dim_names.index(name))
    for step in range(STEPS):
        x, y = batch(step, padded)
        rows = ROWS // dp_size
        x, y = x[dp * rows : (dp + 1) * rows], y[dp * rows : (dp + 1) * rows]
        loss = pipe.step(x, y)
        if abs(float(loss - want_losses[step])) > 1e-12:
            failures.append(
                f"{label} step {step}: loss {float(loss)} vs {float(want_losses[step])}"
            )
        if step == 0:
            for name, p in pipetrain_named(pipe):
                d = _differ(p.grad, want_grads[name])
                if d > 1e-12:
                    failures.append(f"{label}: grad {name} differs by {d:.3g}")
        norm = pipe.clip_grad_norm_(max_norm)
        if abs(float(norm) - float(want_norms[step])) > 1e-12:
            failures.append(f"{label} step {step}: norm {float(norm)} vs {float(want_norms[step])}")
        opt.step()
        opt.zero_grad()
    for name, p in pipetrain_named(pipe):
        d = _differ(p.detach(), want_params[name])
        if d > 1e-12:
            failures.append(f"{label}: parameter {name} after {STEPS} steps differs by {d:.3g}")
    pipe.close()
    return failures


def pipetrain_named(pipe):
    """(global name, parameter) of this rank's stages, each parameter once."""
    seen = set()
    for s in sorted(pipe.modules):
        for name, p in pipe.modules[s].named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield name, p


def run_tensor_parallel(rank: int, world: int, shape: tuple[int, ...], names, cases) -> dict:
    """Every case on a mesh of ``shape`` named ``names``; returns failures and refusals."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    failures = []
    for case in cases:
        blocks = case.get("blocks", 4)
        try:
            failures += run_case(mesh, case, blocks)
        except Exception as e:  # reported with the case; later cases would wait on a peer
            failures.append(f"{case}: {type(e).__name__}: {e}")
            break
    plain = "tp" in names and len(names) == 2
    return {"failures": failures, "errors": refusals(mesh) if plain else {}}


def refusals(mesh) -> dict[str, str]:
    """What a (pp, tp) mesh refuses at construction: the error each rank raised."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    import pipetrain

    def attempt(**kwargs):
        layers = build_layers(2)
        parallelize(layers, mesh["tp"], False)
        stages = kwargs.pop("stages", None) or pipetrain.split(layers, [2, 2])
        return pipetrain.Pipeline(stages, "1f1b", 2, mean_loss, device="cpu", **kwargs)

    cp = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=("pp", "cp"))
    errors = {
        "cp": _error_of(lambda: attempt(mesh=cp)),
        "group_with_dtensors": _error_of(lambda: attempt(group=mesh["pp"].get_group())),
        "ddp_without_dp": _error_of(lambda: attempt(mesh=mesh, data_parallel="ddp")),
    }
    dist.barrier()
    return errors


def _zeroed(layers: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Layers whose parameters a load must set (all zero: nothing left from the seeded init)."""
    with torch.no_grad():
        for layer in layers.values():
            for p in layer.parameters():
                p.zero_()
    return layers


def _compare_loaded(stages, want: dict, label: str) -> list[str]:
    out = []
    for module in stages:
        for name, p in module.named_parameters():
            d = _differ(p.detach(), want[name])
            if d > 1e-12:
                out.append(f"{label}: {name} differs by {d:.3g}")
    return out


def save_at_pp2_tp2_and_load_at_pp4_and_unsplit(rank: int, world: int, path: str) -> list[str]:
    """One AdamW step at (pp=2, tp=2), saved; loaded at pp=4 (no tensor parallel) and into the
    unsplit model: every parameter equals the reference's after that step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import pipetrain

    *_, want = reference_after(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    layers = build_layers(4)
    parallelize(layers, mesh["tp"], False)
    pipe = pipetrain.Pipeline(pipetrain.split(layers, [3, 3]), "1f1b", 4, mean_loss, mesh=mesh)
    opt = torch.optim.AdamW(list(pipe.parameters()), lr=0.05)
    x, y = batch(0)
    pipe.step(x, y)
    opt.step()
    pipetrain.save_checkpoint(path, pipe, opt)
    failures = _compare_loaded(pipe.modules.values(), want, "saved at (pp=2, tp=2)")
    pipe.close()
    stages = pipetrain.split(_zeroed(build_layers(4)), [2, 1, 1, 2])
    pp4 = pipetrain.Pipeline(stages, "1f1b", 4, mean_loss, device="cpu")
    pipetrain.load_checkpoint(path, pp4)
    failures += _compare_loaded(pp4.modules.values(), want, "loaded at pp=4")
    pp4.close()
    dist.barrier()
    if rank == 0:
        (whole,) = pipetrain.split(_zeroed(build_layers(4)), [6])
        pipetrain.load_checkpoint(path, whole)
        failures += _compare_loaded([whole], want, "loaded unsplit")
    return failures


def load_at_dp2_pp2_tp2(rank: int, world: int, path: str) -> list[str]:
    """The (pp=2, tp=2) checkpoint loaded under FSDP2 at (dp=2, pp=2, tp=2)."""
    from torch.distributed.device_mesh import init_device_mesh

    import pipetrain

    *_, want = reference_after(1)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "pp", "tp"))
    layers = _zeroed(build_layers(4))
    parallelize(layers, mesh["tp"], False)
    stages = pipetrain.split(layers, [3, 3])
    pipe = pipetrain.Pipeline(stages, "1f1b", 4, mean_loss, mesh=mesh, data_parallel="fsdp")
    pipetrain.load_checkpoint(path, pipe)
    failures = _compare_loaded(pipe.modules.values(), want, "loaded at (dp=2, pp=2, tp=2)")
    pipe.close()
    return failures


def reference_after(steps: int):
    """``reference`` for ``steps`` steps of the mean loss, without clipping."""
    return reference(4, mean_loss, False, max_norm=float("inf"), steps=steps)


def run_3d(rank: int, world: int, cases: list[dict], path: str) -> list[str]:
    """(dp=2, pp=2, tp=2) under FSDP2: the training cases, then the (pp=2, tp=2) checkpoint;
    then HSDP (dp_replicate=2, dp_shard=2, pp=2)."""
    result = run_tensor_parallel(rank, world, (2, 2, 2), ("dp", "pp", "tp"), cases)
    failures = result["failures"] + load_at_dp2_pp2_tp2(rank, world, path)
    hsdp = {"schedule": "zbv", "stage_layers": [2, 1, 1, 2], "defer": True}
    hsdp |= {"data_parallel": "fsdp", "loss": "token_mean", "microbatches": 2}
    shape, names = (2, 2, 2), ("dp_replicate", "dp_shard", "pp")
    return failures + run_tensor_parallel(rank, world, shape, names, [hsdp])["failures"]
