"""The simulator's prediction for each row of ``moe_overlap_gpu.py``, made before the runs.

Stage costs come from a short profile of the model's own layers on each rank's device (the
master copy, experts unsplit): per micro-batch, the embedding's forward and backward, one MoE
decoder layer's forward, input gradient (``autograd.grad`` to its input alone) and full
backward, and the final norm + head + loss likewise (the median of a few calls after a warm-up;
rank 0's numbers are used). An unsplit layer does the expert work one rank does under expert
parallel when routing is balanced (it computes ``E / ep`` experts for ``ep`` ranks' tokens).

The expert link is measured here unless ``--ep-link-gbs`` gives it: ``all_to_all_single`` over the
ep group of one layer's dispatch (tokens × top-k × hidden values, even splits), the bytes that
leave each rank over the median time, in GB/s. Each MoE layer's ``dispatched_bytes`` is
``planner.costs_file_moe.dispatched_bytes`` (balanced routing: ``(ep − 1) / ep`` of the copies
leave the rank), priced at that link, dispatch and combine each way; the activation sent between
stages is priced at the same link.

Per row, the program the ``Pipeline`` runs (``build_schedule``, lowered) and the planner's
``stage_costs`` give the simulated step (``simulate``'s makespan: the pipeline alone, without
the optimizer step and the dense gradients' all-reduce) and the hidden share of the all-to-all
(``sim.all_to_all.all_to_all_share``). DualPipeV without overlap runs each F&B pair as its
forward, then its backward (``Pipeline(overlap_pairs=False)``): its program has the two parts in
that order in place of each pair, so nothing is hidden; with overlap a pair lasts
``sim.costs.overlapped_pair`` of its halves.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.moe.moe_overlap_model import ROWS, STAGES_PER_RANK, Shape, cut
from pipetrain.planner.costs_file import LayerCost, ModelCosts
from pipetrain.planner.costs_file_moe import dispatched_bytes
from pipetrain.planner.judge import stage_costs
from pipetrain.schedule.lower import lower
from pipetrain.schedule.registry import build_schedule
from pipetrain.schedule.validate import validate
from pipetrain.sim.all_to_all import all_to_all_share
from pipetrain.sim.simulate import simulate


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> float:
    """The median wall time of ``fn`` (ms), the device synchronised around each call."""
    times = []
    for i in range(warmup + iters):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def _pass_times(
    forward: Callable[[], torch.Tensor], x: torch.Tensor | None, device, iters: int, warmup: int
) -> tuple[float, float, float]:
    """(forward, input gradient, full backward) ms of ``forward`` (a scalar or a tensor, fed a
    random output gradient); the input gradient is 0 without an input ``x`` that needs one."""

    def grad_of(out: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(out) if out.dim() == 0 else torch.randn_like(out)

    f = median_ms(forward, device, iters, warmup)

    def full() -> None:
        out = forward()
        out.backward(grad_of(out))

    def input_only() -> None:
        out = forward()
        torch.autograd.grad(out, x, grad_of(out))

    fb = median_ms(full, device, iters, warmup)
    fi = median_ms(input_only, device, iters, warmup) if x is not None else f
    return f, max(fi - f, 0.0), max(fb - f, 0.0)


def profile_layers(shape: Shape, master: dict, device: torch.device, iters: int = 3) -> dict:
    """Per micro-batch (ms): the embedding's, one MoE layer's and the head's (final norm, head
    and loss) forward ``F``, input gradient ``I`` and backward ``B`` on this rank's device."""
    from pipetrain.hf import causal_lm_loss

    dtype = getattr(torch, shape.dtype)
    warmup = 2 if device.type == "cuda" else 1
    ids = torch.randint(0, shape.vocab, (shape.mb_size, shape.seq), device=device)
    x = torch.randn(shape.mb_size, shape.seq, shape.hidden, device=device, dtype=dtype)
    x.requires_grad_(True)
    embed, layer = master["model.embed_tokens"], master["model.layers.0"]
    norm, head = master["model.norm"], master["lm_head"]
    out: dict[str, dict[str, float]] = {}
    for name, forward, inp in (
        ("embedding", lambda: embed(ids), None),
        ("moe_layer", lambda: layer(x), x),
        ("head", lambda: causal_lm_loss(head(norm(x)), ids), x),
    ):
        f, i, b = _pass_times(forward, inp, device, iters, warmup)
        out[name] = {"F": f, "I": i, "B": b}
    for module in master.values():
        module.zero_grad(set_to_none=True)
    return out


def measure_link_gbs(shape: Shape, group: Any, device: torch.device, iters: int = 5) -> float:
    """GB/s leaving each rank in one layer's dispatch over ``group`` (every rank calls it)."""
    ep = dist.get_world_size(group)
    if ep < 2:
        raise ValueError("the expert link needs ep >= 2; give --ep-link-gbs")
    rows = shape.mb_size * shape.seq * shape.top_k
    rows -= rows % ep
    dtype = getattr(torch, shape.dtype)
    x = torch.randn(rows, shape.hidden, device=device, dtype=dtype)
    out = torch.empty_like(x)
    ms = median_ms(lambda: dist.all_to_all_single(out, x, group=group), device, iters, 2)
    leaving = x.numel() * x.element_size() * (ep - 1) / ep
    return leaving / (ms * 1e6)


def model_costs(shape: Shape, layers: dict, link_gbs: float) -> ModelCosts:
    """The costs file the profile gives: embedding, ``shape.layers`` MoE layers, norm, head."""
    element = torch.tensor([], dtype=getattr(torch, shape.dtype)).element_size()
    tokens = shape.mb_size * shape.seq
    sent = dispatched_bytes(tokens, shape.top_k, shape.hidden, element, shape.ep)

    def layer(name: str, t: dict, moved: float = 0.0) -> LayerCost:
        w = max(t["B"] - t["I"], 0.0)
        b = t["I"] + w
        return LayerCost(
            name=name,
            forward=t["F"],
            backward_input=t["I"],
            backward_weight=w,
            backward=b,
            activation=0.0,
            params=0.0,
            dispatched_bytes=moved,
        )

    costs = [layer("model.embed_tokens", layers["embedding"])]
    costs += [layer(f"model.layers.{i}", layers["moe_layer"], sent) for i in range(shape.layers)]
    costs += [layer("model.norm", {"F": 0.0, "I": 0.0, "B": 0.0})]
    costs += [layer("lm_head", layers["head"])]
    comm = tokens * shape.hidden * element / (link_gbs * 1e6)
    meta = {"ep": {"degree": shape.ep, "dispatched_bytes": "derived"}}
    return ModelCosts(layers=tuple(costs), comm=comm, ep_link_gbs=link_gbs, meta=meta)


def predict_row(row: str, shape: Shape, costs: ModelCosts) -> dict:
    """The simulated step (ms) and all-to-all of one row (module docstring)."""
    schedule, overlap = ROWS[row]
    v = STAGES_PER_RANK[schedule]
    program = build_schedule(schedule, shape.pp, shape.microbatches, v)
    if not overlap:  # each F&B pair as its forward, then its backward, as the runtime runs it
        rows = tuple(tuple(p for a in row for p in a.compute_parts) for row in program.actions)
        program = dataclasses.replace(program, actions=rows)
    program = validate(lower(program))
    sim_costs = stage_costs(costs, program, cut(shape.layers, v * shape.pp))
    share = all_to_all_share(program, sim_costs)
    return {
        "step_ms": simulate(program, sim_costs).makespan,
        "all_to_all_ms": list(share.total),
        "exposed_ms": list(share.exposed),
        "hidden_share": share.hidden_share,
    }


def predict(shape: Shape, rows: list[str], layers: dict, link_gbs: float) -> dict:
    """Every row's prediction, with the inputs it came from."""
    costs = model_costs(shape, layers, link_gbs)
    return {
        "layers_ms": layers,
        "ep_link_gbs": link_gbs,
        "dispatched_bytes_per_layer": costs.layers[1].dispatched_bytes,
        "rows": {row: predict_row(row, shape, costs) for row in rows},
    }
