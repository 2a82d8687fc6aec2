"""Per-rank runners for the pair-lane tests (``runtime.pair_lanes``): the spans of every stage
piece a rank runs (which thread, when), and a dense DualPipeV pipeline with ``overlap_pairs``
checked against unsplit training and failing inside a pair's forward lane."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

#: a stage piece's span: (kind, stage, micro-batch, ran on the main thread, start, end)
Span = tuple[str, int, int, bool, float, float]


@contextlib.contextmanager
def recording_spans() -> Iterator[list[Span]]:
    """While inside, every ``StageRunner`` forward and backward piece (``B``, ``I``) of this
    process appends its span to the list yielded."""
    from pipetrain.runtime.stage import StageRunner

    spans: list[Span] = []
    originals = {n: getattr(StageRunner, n) for n in ("forward", "backward", "backward_input")}

    def timed(name: str, method):
        kind = {"forward": "F", "backward": "B", "backward_input": "I"}[name]

        def run(self, mb, *args, **kwargs):
            start = time.perf_counter()
            try:
                return method(self, mb, *args, **kwargs)
            finally:
                main = threading.current_thread() is threading.main_thread()
                spans.append((kind, self.index, mb, main, start, time.perf_counter()))

        return run

    for name, method in originals.items():
        setattr(StageRunner, name, timed(name, method))
    try:
        yield spans
    finally:
        for name, method in originals.items():
            setattr(StageRunner, name, method)


def pairs_of(pipe) -> list[tuple[tuple[str, int, int], tuple[str, int, int]]]:
    """This rank's F&B pairs: ((F, stage, mb), (B or I, stage, mb)) each."""
    row = pipe.program.actions[pipe.rank]
    return [
        tuple((p.kind.name, p.stage, p.microbatch) for p in a.parts)  # type: ignore[misc]
        for a in row
        if a.parts
    ]


def overlapping(spans: list[Span], pairs) -> tuple[set, list]:
    """(the (stage, mb) of forwards run off the main thread, the pairs whose forward ran off
    the main thread while their backward ran on it, spans intersecting)."""
    off_main = {(s, j) for kind, s, j, main, _, _ in spans if kind == "F" and not main}
    found = []
    for (_, fs, fj), (bk, bs, bj) in pairs:
        f = [sp for sp in spans if sp[:3] == ("F", fs, fj) and not sp[3]]
        b = [sp for sp in spans if sp[:3] == (bk, bs, bj) and sp[3]]
        if f and b and f[0][4] < b[0][5] and b[0][4] < f[0][5]:
            found.append(((fs, fj), (bs, bj)))
    return off_main, found


class FailsInLane(torch.nn.Module):
    """``inner``, raising in a forward run off the main thread (a pair's lane) on rank 0."""

    def __init__(self, inner: torch.nn.Module, rank: int) -> None:
        super().__init__()
        self.inner, self.rank = inner, rank

    def forward(self, *args):
        if self.rank == 0 and threading.current_thread() is not threading.main_thread():
            raise RuntimeError("boom in the forward lane")
        return self.inner(*args)


#: how long each piece of the dense stages takes at least (a sleep releases the GIL): longer than
#: a loaded host takes to wake the lane, so a pair's two spans intersect when the lanes run
PIECE_SECONDS = 0.01


class _SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h):
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(PIECE_SECONDS)
        return grad


class Slow(torch.nn.Module):
    """``inner`` with its forward and its backward each lasting at least ``PIECE_SECONDS``
    (the numbers unchanged)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, h, mask):
        time.sleep(PIECE_SECONDS)
        return self.inner(_SleepInBackward.apply(h), mask)


class Dropping(torch.nn.Module):
    """``inner``'s hidden output through a dropout that draws (training, ``p > 0``)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.drop = inner, torch.nn.Dropout(0.25)

    def forward(self, h, mask):
        h, mask = self.inner(h, mask)
        return self.drop(h), mask


def run_dense(rank: int, world: int) -> dict:
    """A dense 4-stage DualPipeV pipeline with ``overlap_pairs`` (both weight-gradient splits):
    loss and every gradient against unsplit training, the pieces' spans; then the same with
    stage 0 raising in its forward lane on rank 0: the error every rank raises."""
    from datetime import timedelta

    import torch.distributed as dist
    from runtime_cases import batch, build_stages, close, loss_fn, reference

    import pipetrain

    inputs, y = batch(8)
    ref_loss, ref_grads = reference(4, inputs, y, 1)
    out: dict = {"failures": [], "spans": {}, "pairs": {}}
    for defer in (True, False):
        stages = build_stages(4)
        slow = [Slow(stage) for stage in stages]  # the same parameters, under the same names
        pipe = pipetrain.Pipeline(
            slow, "dualpipev", 4, loss_fn, overlap_pairs=True, defer_weight_grads=defer
        )
        with pipe, recording_spans() as spans:
            loss = pipe.step(inputs, y)
            out["pairs"][defer] = pairs_of(pipe)
        out["spans"][defer] = spans
        if not close(loss, ref_loss):
            out["failures"].append(f"defer={defer}: loss {loss.item()} != {ref_loss.item()}")
        for s in pipe.modules:
            for n, p in stages[s].named_parameters():
                if not close(p.grad, ref_grads[(s, n)]):
                    out["failures"].append(f"defer={defer}: stage {s} {n} gradient differs")
    for seed in (None, 3):  # a dropout that draws keeps the pairs on one thread, keyed or not
        stages = build_stages(4)
        stages[2] = Dropping(stages[2])
        with pipetrain.Pipeline(
            stages, "dualpipev", 4, loss_fn, overlap_pairs=True, seed=seed
        ) as pipe:
            with recording_spans() as spans:
                pipe.step(inputs, y)
        out[f"dropout seed {seed}: threads"] = sorted({main for *_, main, _, _ in spans})
    stages = build_stages(4)
    stages[0] = FailsInLane(stages[0], rank)
    bad = pipetrain.Pipeline(
        stages, "dualpipev", 4, loss_fn, overlap_pairs=True, timeout=timedelta(seconds=30)
    )
    started = time.perf_counter()
    try:
        bad.step(inputs, y)
        out["error"] = "no error"
    except Exception as e:  # the test checks the type name and message
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.perf_counter() - started
    out["directions"] = run_directions(rank, world)
    dist.barrier()  # rank 0 (the store's host) stays until rank 1 has read the notice
    return out


def _experts_inputs(rank: int, seed: int):
    """One micro-batch of a rank: hidden rows, their top-2 experts of 4, routing weights."""
    g = torch.Generator().manual_seed(100 * seed + rank)
    hidden = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(6)])
    weights = torch.rand(6, 2, generator=g, dtype=torch.float64)
    return hidden, index, weights


def run_directions(rank: int, world: int) -> list[str]:
    """Expert parallel over ep 2 with a pair's two parts in flight on ``PairLanes``: micro-batch
    b's forward on the lane while micro-batch a's backward runs here, the two ranks issuing them
    in opposite orders (rank 0 the forward's all-to-alls first, rank 1 the backward's). Each
    direction on its own group keeps them apart; b's output and a's gradients equal a
    sequential run's."""
    from datetime import timedelta

    import transformers as tf
    from torch.distributed.device_mesh import init_device_mesh

    from pipetrain.runtime.pair_lanes import PairLanes
    from pipetrain.runtime.parallel.expert_parallel import ExpertParallelExperts

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("edp", "ep"))
    config = tf.Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4)
    torch.manual_seed(3)
    experts = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config).double()
    for p in experts.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    layer = ExpertParallelExperts(experts, mesh)

    def run(lanes: PairLanes | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        layer.zero_grad()
        a, b = _experts_inputs(rank, 1), _experts_inputs(rank, 2)
        out_a = layer(*a)
        found: list[torch.Tensor] = []

        def forward() -> None:
            if lanes is not None and rank == 1:
                time.sleep(0.3)
            found.append(layer(*b))

        def backward() -> None:
            if lanes is not None and rank == 0:
                time.sleep(0.3)
            out_a.pow(2).sum().backward()

        if lanes is None:
            forward()
            backward()
        else:
            lanes.run(forward, backward)
        grads = [a[0].grad, *(p.grad.to_local() for p in layer.parameters())]
        return found[0].detach(), [g.clone() for g in grads]

    ref_out, ref_grads = run(None)
    lanes = PairLanes(torch.device("cpu"), timedelta(seconds=30))
    try:
        out, grads = run(lanes)
    finally:
        lanes.close()
    failures = [] if torch.equal(out, ref_out) else ["b's output differs"]
    failures += [
        f"gradient {i} differs"
        for i, (g, r) in enumerate(zip(grads, ref_grads))
        if not torch.equal(g, r)
    ]
    return failures
