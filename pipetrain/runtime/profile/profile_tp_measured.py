"""The profiler's tensor-parallel entries measured on a real group: ``t`` worker processes (NCCL
on GPUs, one per GPU; gloo on a CPU), each building the same layers (same seed, same weights)
and applying the family's tensor-parallel plan to them — the function ``train --tp`` applies, so
what is measured is what trains — then timing each layer as one rank of the group sees it.

Per layer, on every rank (the slowest rank's number kept: the group waits for it):

* ``forward``: the parallelized layer's forward, the last layer with its loss, as the degree-1
  profile times it, less ``forward_collective``;
* ``backward_input``: the gradient of the layer's input alone (``torch.autograd.grad`` on the
  input: autograd runs no weight-gradient kernel), less ``backward_collective``;
  ``backward_weight``: the full backward less the input part — a measured split, not the
  halving ``profile_tp.with_tp`` falls back to when the degree-1 profile has none;
* ``forward_collective`` and ``backward_collective``: the collectives the layer really issues,
  recorded as they are dispatched during one forward and one backward (the functional
  collectives DTensor runs: all-reduce, all-gather, reduce-scatter, with their shapes and
  dtypes), then replayed alone on the group, back to back, the median of ``repeats`` rounds.
  Recording rather than assuming Megatron-LM's two regions per block matters: torch's
  ``ColwiseParallel`` reduces each column-split product's input gradient on its own, so a
  Llama block's backward issues one all-reduce per column-split product, not one per region;
* ``activation``: the bytes of the distinct tensors the forward saves for its backward, counted
  on each rank's local shards (the degree-1 profile's ``saved_tensors_hooks`` count);
  ``params`` and ``gradients``: the rank's local parameter bytes with their gradients and
  optimizer states (``profile_memory.static_bytes``'s rule on the local shards). On a GPU the
  allocator's peak during the layer's forward and backward is kept beside them
  (``peak_gib``, in ``meta["tp"]``): what the saved-tensor count leaves out (temporaries).

Times in context, as the degree-1 profile takes them (``profile_layers``, "Times in context"):
after the lone layers, windows of ``context`` consecutive layers are timed as one chain on the
group (forward; full backward; input part), and each layer's forward is scaled by its window's
forward over the sum of its layers' lone forwards, its full backward and input part both by the
window's full backward over theirs (the split among them kept). A layer's collectives stay as
replayed; its compute is the scaled time less them. The window ratios are in ``meta["tp"]``
under ``windows``, per degree.
Rank 0 writes the entries to a file the parent reads (``worker_group`` spawns, joins and waits
for the processes); a worker that fails or a group that
outlives ``timeout_s`` ends the measurement with one ``ValueError`` line.
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.planner.costs_file_tp import TpCost
from pipetrain.runtime import torch_compat
from pipetrain.runtime.named_layers import Stage, context_windows
from pipetrain.runtime.profile.profile_clock import Clock
from pipetrain.runtime.profile.profile_memory import GIB, OPTIMIZER_STATES
from pipetrain.runtime.profile.worker_group import (
    check_gpus,
    free_port,
    join_group,
    run_group,
    wait_for,
)

#: the functional collectives a tensor-parallel layer issues, replayed by their c10d calls
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
#: seconds a group may take to measure every layer before it is stopped (and its collectives'
#: own timeout)
TIMEOUT_S = 600.0
#: the numbers each rank reports per layer, reduced by their maximum over the group
_NUMBERS = ("forward", "backward", "backward_input", "fwd_coll", "bwd_coll", "activation")


@dataclass(frozen=True)
class Parallelized:
    """What a worker measures: the layers, already tensor-parallelized on the group, in call
    order; the loss the last one runs with; its first input and the loss's target."""

    layers: Sequence[nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor


#: builds ``Parallelized`` on each rank from ``(tp_mesh, device)``; picklable (a module-level
#: function or a ``functools.partial`` of one), as the workers are spawned
Build = Callable[[Any, torch.device], Parallelized]


@dataclass(frozen=True)
class _Job:
    build: Build
    degree: int
    device_type: str
    repeats: int
    optimizer: str
    timeout_s: float
    port: int
    out: str
    context: int = 1


def measure_degree(
    build: Build,
    degree: int,
    device_type: str,
    *,
    repeats: int = 5,
    optimizer: str = "adamw",
    timeout_s: float = TIMEOUT_S,
    context: int = 1,
) -> tuple[list[TpCost], list[float] | None, list[dict]]:
    """Each layer's entry at ``degree``, measured on ``degree`` spawned processes (scaled by
    windows of ``context`` layers), on a GPU each layer's peak GiB per rank (``None`` on a
    CPU), and the windows' ratios. ``ValueError``: a worker failed (its error, one line) or the
    group did not finish within ``timeout_s``."""
    what = f"tensor-parallel degree {degree}"
    check_gpus(device_type, degree, what)
    if device_type == "cuda":  # the parent's cached blocks on GPU 0, which rank 0 shares
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="pipetrain-tp-") as scratch:
        out = Path(scratch) / "entries.json"
        job = _Job(
            build,
            degree,
            device_type,
            repeats,
            optimizer,
            timeout_s,
            free_port(),
            str(out),
            context,
        )
        run_group(_worker, job, degree, f"measuring {what}", timeout_s)
        raw = json.loads(out.read_text())  # rank 0 wrote it before the group's last barrier
    entries = [TpCost(degree=degree, source="measured", **fields) for fields in raw["entries"]]
    return entries, raw["peak_gib"], raw["windows"]


def _wait(context: Any, degree: int, timeout_s: float) -> None:
    """Until every worker ends (``worker_group.wait_for``, worded for a tensor-parallel
    degree)."""
    wait_for(context, f"measuring tensor-parallel degree {degree}", timeout_s)


def _worker(rank: int, job: _Job) -> None:
    """One rank of the group: join it, build and parallelize the layers, measure them; rank 0
    writes the group's entries (each number the maximum over the ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    device = join_group(rank, job.degree, job.device_type, job.port, job.timeout_s)
    try:
        mesh = init_device_mesh(device.type, (job.degree,), mesh_dim_names=("tp",))
        model = job.build(mesh["tp"], device)
        group = mesh["tp"].get_group()
        entries, peaks, windows = measure_on_group(
            model, group, device, repeats=job.repeats, optimizer=job.optimizer, context=job.context
        )
        if rank == 0:
            said = {"entries": entries, "peak_gib": peaks, "windows": windows}
            Path(job.out).write_text(json.dumps(said))
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group()


def measure_on_group(
    model: Parallelized,
    group: Any,
    device: torch.device,
    *,
    repeats: int,
    optimizer: str,
    context: int = 1,
) -> tuple[list[dict[str, float]], list[float] | None, list[dict]]:
    """Every rank of ``group`` calls: each layer's ``TpCost`` fields (the times the slowest
    rank's, scaled by windows of ``context`` layers; the memory this rank's: the ranks hold
    equal shares), on a GPU each layer's allocator peak on this rank, and the windows."""
    rows, static, peaks, layer_inputs = _measure_layers(model, group, device, repeats, optimizer)
    spans = [(w.start, w.stop) for w in context_windows(len(rows), context)]
    clock = Clock(device)
    chains = [_window_times(model, layer_inputs, a, b, clock, group, repeats) for a, b in spans]
    slowest, chained = (_slowest(numbers, group, device) for numbers in (rows, chains))
    scaled, windows = scale_by_windows(slowest, spans, chained)
    entries = [_entry(row, own) for row, own in zip(scaled, static, strict=True)]
    return entries, peaks, windows


def _slowest(rows: list[list[float]], group: Any, device: torch.device) -> list[list[float]]:
    """``rows`` with each number the largest over the ranks of ``group`` (every rank calls)."""
    if not rows:
        return []
    numbers = torch.tensor(rows, dtype=torch.float64, device=device)
    dist.all_reduce(numbers, op=dist.ReduceOp.MAX, group=group)
    return numbers.tolist()


def scale_by_windows(
    rows: list[list[float]], spans: list[tuple[int, int]], chains: list[list[float]]
) -> tuple[list[list[float]], list[dict]]:
    """``rows`` (``_NUMBERS`` per layer, alone) scaled by each window ``spans[k]`` timed as one
    chain (``chains[k]``: forward, full backward, input part): the forward by the chain's
    forward over the sum of its layers', the full backward and the input part both by the
    chain's full backward over theirs; the collectives and the memory as they were."""
    out = [list(row) for row in rows]
    windows = []
    for (first, end), (forward, backward, _) in zip(spans, chains, strict=True):
        alone_f = sum(rows[i][0] for i in range(first, end))
        alone_b = sum(rows[i][1] for i in range(first, end))
        rf = forward / alone_f if alone_f > 0 else 1.0
        rb = backward / alone_b if alone_b > 0 else 1.0
        for i in range(first, end):
            out[i][0] *= rf
            out[i][1] *= rb
            out[i][2] *= rb
        windows.append({"first": first, "end": end, "forward": rf, "backward": rb})
    return out, windows


def _window_times(
    model: Parallelized,
    layer_inputs: list[tuple[torch.Tensor, ...]],
    first: int,
    end: int,
    clock: Clock,
    group: Any,
    repeats: int,
) -> list[float]:
    """Layers ``first..end-1`` timed as one chain on the group, as a stage runs them (the loss
    with the last layer): median ms of the forward, the full backward and the input part."""
    last = end == len(model.layers)
    chain = Stage([(f"layer{i}", model.layers[i]) for i in range(first, end)])
    timer = _LayerTimer(chain, layer_inputs[first], model.loss_fn if last else None, model.target)
    times = timer.times(clock, group, repeats)
    for layer in model.layers[first:end]:
        for p in layer.parameters():
            p.grad = None
    return times


def _entry(row: list[float], static: tuple[float, float]) -> dict[str, float]:
    """A ``TpCost``'s fields from one layer's numbers: the compute without the collectives."""
    forward, backward, backward_input, fwd_coll, bwd_coll, activation = row
    i = max(backward_input - bwd_coll, 0.0)
    w = max(backward - backward_input, 0.0)
    return {
        "forward": max(forward - fwd_coll, 0.0),
        "backward_input": i,
        "backward_weight": w,
        "backward": i + w,
        "forward_collective": fwd_coll,
        "backward_collective": bwd_coll,
        "activation": activation,
        "params": static[0],
        "gradients": static[1],
    }


def _measure_layers(
    model: Parallelized, group: Any, device: torch.device, repeats: int, optimizer: str
) -> tuple[
    list[list[float]], list[tuple[float, float]], list[float] | None, list[tuple[torch.Tensor, ...]]
]:
    """Per layer: ``_NUMBERS`` on this rank, its static GiB (parameters with gradients and
    optimizer states; gradients alone), on a GPU the allocator's peak GiB, and its inputs."""
    clock = Clock(device)
    states = OPTIMIZER_STATES[optimizer]
    seen: set[int] = set()
    inputs = model.inputs
    rows, static, peaks, layer_inputs = [], [], [], []
    for n, layer in enumerate(model.layers):
        layer_inputs.append(inputs)
        last = n == len(model.layers) - 1
        timer = _LayerTimer(layer, inputs, model.loss_fn if last else None, model.target)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        saved, recorded, outputs = timer.record()
        if device.type == "cuda":
            peaks.append((torch.cuda.max_memory_allocated(device) - before) / GIB)
        times = timer.times(clock, group, repeats)
        forward_coll = _replay_ms(recorded["forward"], clock, group, repeats)
        backward_coll = _replay_ms(recorded["backward"], clock, group, repeats)
        rows.append([*times, forward_coll, backward_coll, saved / GIB])
        static.append(_local_static_gib(layer, seen, states))
        for p in layer.parameters():
            p.grad = None
        inputs = outputs
    return rows, static, peaks if device.type == "cuda" else None, layer_inputs


class _LayerTimer:
    """One layer's forward (with the loss on the last layer) and backward pieces, each timed
    after a barrier so the ranks start together."""

    def __init__(
        self,
        layer: nn.Module,
        inputs: tuple[torch.Tensor, ...],
        loss_fn: Callable[..., torch.Tensor] | None,
        target: torch.Tensor,
    ) -> None:
        self.layer, self.inputs, self.loss_fn, self.target = layer, inputs, loss_fn, target

    def forward(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], Any]:
        """The leaves (inputs needing gradients), the layer's outputs, and what the backward
        starts from (the loss on the last layer, else the outputs)."""
        args = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in self.inputs)
        out = self.layer(*args)
        outputs = out if isinstance(out, tuple) else (out,)
        _detached(outputs)  # waits for an output's collective: the forward ends with it
        roots: Any = (self.loss_fn(out, self.target),) if self.loss_fn is not None else outputs
        leaves = tuple(a for a in args if a.requires_grad)
        return leaves, outputs, roots

    @staticmethod
    def _seeds(roots: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        return [None if r.dim() == 0 else torch.ones_like(r) for r in roots]

    def record(self) -> tuple[int, dict[str, list[tuple[str, torch.Size, torch.dtype]]], tuple]:
        """One forward and backward: the bytes the forward saves (local shards), the
        collectives each issues, and the outputs (the next layer's inputs)."""
        saved = _SavedLocalBytes(self.layer)
        recorder = _Collectives()
        with recorder, torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            _, outputs, roots = self.forward()
        forward = list(recorder.calls)
        recorder.calls.clear()
        with recorder:
            torch.autograd.backward(list(roots), self._seeds(roots))
        backward = list(recorder.calls)
        return saved.bytes, {"forward": forward, "backward": backward}, _detached(outputs)

    def times(self, clock: Clock, group: Any, repeats: int) -> list[float]:
        """Median ms of the forward, the full backward and the input part alone."""
        forward, backward, backward_input = [], [], []
        for _ in range(repeats + 1):  # the first round warms up
            dist.barrier(group=group)
            forward.append(clock.time(self.forward)[0])
            _, _, roots = self.forward()
            dist.barrier(group=group)
            backward.append(clock.time(functools.partial(self._backward, roots))[0])
            leaves, _, roots = self.forward()
            dist.barrier(group=group)
            backward_input.append(clock.time(functools.partial(self._grad, roots, leaves))[0])
        medians = [statistics.median(x[1:]) for x in (forward, backward, backward_input)]
        return medians

    def _backward(self, roots: Sequence[torch.Tensor]) -> None:
        torch.autograd.backward(list(roots), self._seeds(roots))

    def _grad(self, roots: Sequence[torch.Tensor], leaves: tuple[torch.Tensor, ...]) -> None:
        if leaves:  # the embedding's input is token ids: no input gradient to compute
            torch.autograd.grad(list(roots), list(leaves), self._seeds(roots))


def _detached(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The outputs as plain tensors, waited for (an async collective's result included)."""
    waited = tuple(o.wait() if hasattr(o, "wait") else o for o in outputs)
    return tuple(o.detach() for o in waited)


class _Collectives(torch_compat.TorchDispatchMode):
    """Records the functional collectives dispatched under it: (name, input shape, dtype).
    DTensor ops are handed back to DTensor (``NotImplemented``), whose own dispatch then issues
    the collectives on local tensors, which this mode sees — as torch's ``CommDebugMode``
    does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.Size, torch.dtype]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in COLLECTIVES:
            self.calls.append((name, args[0].shape, args[0].dtype))
        return func(*args, **(kwargs or {}))


def _replay_ms(
    calls: list[tuple[str, torch.Size, torch.dtype]], clock: Clock, group: Any, repeats: int
) -> float:
    """Median ms of ``calls`` replayed back to back on ``group`` (0 for none)."""
    if not calls:
        return 0.0
    size = dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if clock.cuda else None
    work: list[Callable[[], object]] = []
    for name, shape, dtype in calls:
        x = torch.ones(shape, dtype=dtype, device=device)
        if name == "all_gather_into_tensor":
            out = torch.empty((shape[0] * size, *shape[1:]), dtype=dtype, device=device)
            work.append(functools.partial(dist.all_gather_single, out, x, group=group))
        elif name == "reduce_scatter_tensor":
            out = torch.empty((shape[0] // size, *shape[1:]), dtype=dtype, device=device)
            work.append(functools.partial(dist.reduce_scatter_single, out, x, group=group))
        else:
            work.append(functools.partial(dist.all_reduce, x, group=group))

    def run() -> None:
        for call in work:
            call()

    times = []
    for _ in range(repeats + 1):
        dist.barrier(group=group)
        times.append(clock.time(run)[0])
    return statistics.median(times[1:])


class _SavedLocalBytes:
    """The distinct storages a forward saves for backward, parameters excluded, counted on
    this rank's local shards (a DTensor counts its local tensor)."""

    def __init__(self, module: nn.Module) -> None:
        self.params = {_local(p).untyped_storage().data_ptr() for p in module.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and key not in self.seen:
            self.seen.add(key)
            self.bytes += storage.nbytes()
        return t


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (or an async collective's result), else the tensor."""
    while True:
        inner = getattr(t, "_local_tensor", None)
        if inner is None:
            inner = getattr(t, "elem", None)
        if not isinstance(inner, torch.Tensor):
            return t
        t = inner


def _local_static_gib(layer: nn.Module, seen: set[int], states: int) -> tuple[float, float]:
    """GiB of the rank's local parameters with gradients and ``states`` optimizer states, and
    of its gradients alone; a parameter ``seen`` on an earlier layer counts there only."""
    total = trained = 0
    for p in layer.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        local = _local(p)
        size = local.numel() * local.element_size()
        total += size * (1 + (1 + states if p.requires_grad else 0))
        trained += size if p.requires_grad else 0
    return total / GIB, trained / GIB
