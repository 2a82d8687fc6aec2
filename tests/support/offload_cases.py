"""Per-rank runner for ``test_runtime_offload``: ``Pipeline(offload=...)`` against unsplit
training in float64 on gloo, where a copy to host memory is a plain copy into new storage. Each
stage is a list of ``LAYERS`` blocks (the last one's ends in the head), so offload moves layer by
layer; one case runs plain modules, which move in one piece."""

from __future__ import annotations

from itertools import pairwise

import torch
from torch import nn

WIDTH = 32
ROWS = 8  # rows per micro-batch: each saved activation is ROWS × WIDTH float64 (2 KiB)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        return torch.sin(self.b(torch.tanh(self.a(h)))) + h


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, h):
        return self.out(torch.relu(h))


#: layers per stage of a layered case
LAYERS = 3
#: one saved activation of a micro-batch, in bytes
UNIT = ROWS * WIDTH * 8


def build(num_stages: int, layered: bool = False) -> list[nn.Module]:
    stages: list[nn.Module] = []
    for i in range(num_stages):
        torch.manual_seed(100 + i)
        if not layered:
            stages.append((Head() if i == num_stages - 1 else Block()).double())
            continue
        layers = [Block() for _ in range(LAYERS)]
        stages.append(nn.Sequential(*layers, *([Head()] if i == num_stages - 1 else [])).double())
    return stages


def layer_bytes(layers: int) -> list[int]:
    """What each block of a layered stage saves that offload moves: its input (but the first
    block's, the stage's input, a leaf the stage holds anyway), ``tanh``'s output and ``b``'s."""
    return [2 * UNIT] + [3 * UNIT] * (layers - 1)


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def _reference(num_stages: int, x, y, steps: int, layered: bool):
    stages = build(num_stages, layered)
    for _ in range(steps):
        h = x
        for m in stages:
            h = m(h)
        loss = loss_fn(h, y)
        loss.backward()
    grads = {(s, n): p.grad.clone() for s, m in enumerate(stages) for n, p in m.named_parameters()}
    return loss.detach(), grads


#: (schedule, stages per rank, micro-batches, offload fraction of every stage but the last,
#: whether stages are lists of layers)
CASES = [
    ("1f1b", 1, 4, 1.0, True),
    ("1f1b", 1, 4, 0.5, False),
    ("interleaved-1f1b", 2, 4, 0.5, True),
    ("zb-h1", 1, 4, 1.0, True),
    ("zbv", 2, 4, 0.75, True),
    ("zbv", 2, 4, 0.3, True),
    ("dualpipev", 2, 6, 1.0, True),
]
STEPS = 2


def run_offload(rank: int, world: int, defer_weight_grads: bool) -> dict:
    """Per case: the differences from unsplit training (empty when exact), and per local
    offloaded stage (bytes moved to host, bytes the offloaded micro-batches saved, fraction,
    the bytes layer-by-layer offload should have moved — ``None`` for a stage in one piece)."""
    import pipetrain
    from pipetrain.schedule.action import OpKind
    from pipetrain.schedule.offload import offloaded_layers

    out: dict = {"differences": [], "moved": {}}
    for name, v, m, fraction, layered in CASES:
        num_stages = world * v
        stages = build(num_stages, layered)
        offload = [fraction] * (num_stages - 1) + [0.0]
        pipe = pipetrain.Pipeline(
            stages, name, m, loss_fn, stages_per_rank=v, device="cpu",
            defer_weight_grads=defer_weight_grads, offload=offload,
        )  # fmt: skip
        for runner in pipe._runners.values():
            if runner.offload is not None:
                runner.offload.min_bytes = 0  # every activation here is 2 KiB
        g = torch.Generator().manual_seed(3)
        x = torch.randn(ROWS * m, WIDTH, generator=g, dtype=torch.float64)
        y = torch.randn(ROWS * m, 2, generator=g, dtype=torch.float64)
        losses = [pipe.step(x, y) for _ in range(STEPS)]
        ref_loss, ref_grads = _reference(num_stages, x, y, STEPS, layered)
        for i, loss in enumerate(losses):
            if abs(float(loss) - float(ref_loss)) > 1e-12 * abs(float(ref_loss)):
                out["differences"].append(f"{name}: step {i} loss {float(loss)} != {ref_loss}")
        for s in pipe.placement.stages_of_rank(rank):
            for n, p in stages[s].named_parameters():
                ref = ref_grads[(s, n)]
                if p.grad is None or (p.grad - ref).abs().max() > 1e-12 * ref.abs().max():
                    out["differences"].append(f"{name}: stage {s} {n} gradient differs")
            stage_offload = pipe._runners[s].offload
            if stage_offload is not None:
                row = pipe.program.actions[rank]
                copies = sum(a.kind is OpKind.OFFLOAD and a.stage == s for a in row)
                moved_layers = offloaded_layers(fraction, LAYERS)
                expected = STEPS * copies * sum(layer_bytes(LAYERS)[:moved_layers])
                moved = (stage_offload.moved_bytes, stage_offload.saved_bytes, fraction,
                         expected if layered else None)  # fmt: skip
                out["moved"][f"{name} {fraction} stage {s}"] = moved
        assert all(r.leftovers() == 0 for r in pipe._runners.values())
        pipe.close()
    out["refusals"] = _refusals(world)
    out["from_plan"] = _from_plan(world)
    return out


def _from_plan(world: int) -> tuple[float | None, int, bool]:
    """A plan's ``offload`` and ``reload_lead`` applied by ``Pipeline.from_plan``: (the bytes
    stage 0 moved where it lives on this rank, else None; how many OFFLOAD actions this rank's
    program holds; whether each RELOAD is issued right before its backward, as lead 0 says)."""
    import pipetrain
    from pipetrain.schedule.action import OpKind

    layers = build(world)
    plan = {"schedule": "1f1b", "ranks": world, "stages_per_rank": 1, "microbatches": 4,
            "stage_layers": [1] * world, "offload": [1.0] + [0.0] * (world - 1),
            "reload_lead": [0] * world}  # fmt: skip
    pipe = pipetrain.Pipeline.from_plan(layers, plan, loss_fn=loss_fn, device="cpu")
    for runner in pipe._runners.values():
        if runner.offload is not None:
            runner.offload.min_bytes = 0
    g = torch.Generator().manual_seed(4)
    x = torch.randn(ROWS * 4, WIDTH, generator=g, dtype=torch.float64)
    pipe.step(x, torch.randn(ROWS * 4, 2, generator=g, dtype=torch.float64))
    offload = pipe._runners[0].offload if 0 in pipe._runners else None
    row = [a for a in pipe.program.actions[pipe.rank] if a.is_compute or a.kind is OpKind.RELOAD]
    copies = sum(a.kind is OpKind.OFFLOAD for a in pipe.program.actions[pipe.rank])
    just_before = all(
        nxt.kind is OpKind.B and nxt.microbatch == a.microbatch
        for a, nxt in pairwise(row)
        if a.kind is OpKind.RELOAD
    )
    pipe.close()
    return (None if offload is None else offload.moved_bytes), copies, just_before


def _refusals(world: int) -> dict[str, str]:
    import pipetrain

    found = {}
    from pipetrain.schedule.lower import lower
    from pipetrain.schedule.offload import insert_offload
    from pipetrain.schedule.registry import build_schedule

    with_copies = insert_offload(lower(build_schedule("1f1b", world, 4)), [1.0, 0.0])
    cases = (("range", "1f1b", [1.5, 0.0]), ("length", "1f1b", [0.5]),
             ("nothing", "1f1b", [0.0, 1.0]), ("copies", with_copies, None))  # fmt: skip
    for label, schedule, offload in cases:
        try:
            pipetrain.Pipeline(build(world), schedule, 4, loss_fn, device="cpu", offload=offload)
        except ValueError as e:
            found[label] = str(e)
    # a program that carries its own copies runs them, moving what offload= says
    pipe = pipetrain.Pipeline(build(world), with_copies, 4, loss_fn, device="cpu",
                              offload=[1.0, 0.0])  # fmt: skip
    for runner in pipe._runners.values():
        if runner.offload is not None:
            runner.offload.min_bytes = 0
    x = torch.randn(ROWS * 4, WIDTH, dtype=torch.float64)
    pipe.step(x, torch.randn(ROWS * 4, 2, dtype=torch.float64))
    runner = pipe._runners.get(0)
    found["own copies moved"] = str(runner.offload.moved_bytes if runner and runner.offload else 0)
    pipe.close()
    return found


def run_offload_with_recompute(rank: int, world: int, defer_weight_grads: bool) -> dict:
    """The built-in GPT (float64) under a zbv plan whose stages recompute (full) and offload, against the same plan with neither: the largest relative difference of the loss and
    of every gradient, and the bytes each local offloading stage moved."""
    import torch.distributed as dist

    import pipetrain
    from pipetrain.app.catalog import ModelShape
    from pipetrain.app.catalog import build as build_model

    shape = ModelShape(model="gpt", blocks=5, hidden=32, heads=4, kv_heads=None, vocab=64,
                       seq_len=16, dtype="float64", seed=5)  # fmt: skip
    tokens = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(tokens, -1, dims=1)
    layers = len(build_model(shape).names)
    # stages 1 and 2 hold two checkpointed blocks each: what autograd saves outside a checkpoint
    # is its input, and the second block's (the first's is the stage's input) moves
    base = {"schedule": "zbv", "ranks": world, "stages_per_rank": 2, "microbatches": 4,
            "stage_layers": [1, 2, 2, layers - 5]}  # fmt: skip
    both = {**base, "recompute": ["none", "full", "full", "none"],
            "offload": [1.0, 1.0, 0.6, 0.0]}  # fmt: skip
    runs = []
    for plan in (base, both):
        model = build_model(shape)
        pipe = pipetrain.Pipeline.from_plan(
            model.layers, plan, loss_fn=model.loss_fn, device="cpu",
            defer_weight_grads=defer_weight_grads,
        )  # fmt: skip
        for runner in pipe._runners.values():
            if runner.offload is not None:
                runner.offload.min_bytes = 0  # this model's activations are a few KiB
        loss = float(pipe.step(*model.batch(tokens, targets)))
        grads = {n: p.grad.clone() for m in pipe.modules.values()
                 for n, p in m.named_parameters() if p.grad is not None}  # fmt: skip
        moved = {s: r.offload.moved_bytes for s, r in pipe._runners.items() if r.offload}
        pipe.close()
        gathered: list = [None] * world
        dist.all_gather_object(gathered, grads)
        runs.append((loss, {n: g for part in gathered for n, g in part.items()}, moved))
    (loss0, grads0, _), (loss1, grads1, moved) = runs
    worst = abs(loss1 - loss0) / abs(loss0)
    for name, g in grads0.items():
        worst = max(worst, float((grads1[name] - g).abs().max() / g.abs().max()))
    refused = ""
    try:  # selective recompute with offload on one stage: refused on every rank, from the plan
        pipetrain.Pipeline.from_plan(
            build_model(shape).layers, {**both, "recompute": ["none", "selective", "full", "none"]},
            loss_fn=build_model(shape).loss_fn, device="cpu",
        )  # fmt: skip
    except ValueError as e:
        refused = str(e)
    return {"difference": worst, "same_names": grads0.keys() == grads1.keys(), "moved": moved,
            "refused": refused}  # fmt: skip
