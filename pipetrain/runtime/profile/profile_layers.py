"""The profiler: what each layer of a model costs, measured on the current device, written as a
costs file (``pipetrain.planner.costs_file``, docs/planning.md) for the planner.

``layers`` is the model as a chain (each layer's output, a tensor or a tuple of tensors, is the
next one's input). Per layer this measures, with the runtime's own stage code (``StageRunner``,
so ``I`` and ``W`` are split exactly as a pipeline splits them):

* ``forward``, ``backward`` (full), ``backward_input`` and ``backward_weight`` in milliseconds:
  each timed over ``in_flight`` micro-batches run back to back (as a pipeline's steady state
  runs them, so the host queues kernels ahead and launch gaps do not count; one at a time with a
  synchronisation around each over-estimated a block, measured: ``docs/performance.md``) and divided
  by their number; the median over ``repeats`` rounds after ``warmup`` rounds, timed with CUDA
  events on a GPU and ``time.perf_counter`` on a CPU — or, with ``timing="device"``, as the
  device's busy time alone (``runtime.profile.profile_clock``); ``.grad`` is kept between rounds as
  ``zero_grad(set_to_none=False)`` keeps it, so backward pieces add into it as they do in training; the last layer's forward and backward include ``loss_fn``, as
  the last stage's do in a pipeline;
* ``activation``: the bytes of the distinct tensors the layer's forward saves for its backward
  (a ``saved_tensors_hooks`` count; parameters excluded, the layer's input included), which is
  what a micro-batch holds from the layer's forward until its backward ends;
* ``params``: static memory — parameters, their gradients and the optimizer's state (AdamW and
  Adam: two states per parameter, SGD with momentum: one, plain SGD: none; torch.optim keeps the
  states in the parameter's dtype); a parameter shared by several layers counts once, on the
  first; ``optimizer_workspace``, what the optimizer's update allocates for them while it runs
  (``OPTIMIZER_TEMPORARIES`` parameter-sized temporaries: one for AdamW and Adam);
* ``comm``: moving the layer's output to the next rank. With two or more GPUs visible, a copy
  from this GPU to another one (peer-to-peer, what NCCL's send/recv rides on within a host);
  with one GPU, a device-to-device copy on it (a lower bound); on a CPU, a stated model:
  ``CPU_LATENCY_MS`` plus the bytes at ``CPU_BANDWIDTH`` (gloo over loopback);
* ``recompute_activation``: the same count with the layer checkpointed as a plan's recompute
  runs it (``activation_checkpoint.Recomputed``, full): its input, and on the last layer what
  ``loss_fn`` saves, which runs outside the checkpointed region; ``selective_activation``, the
  same under selective recompute, with the outputs it caches (matrix products, fused attention)
  counted as they are made; ``recompute`` and ``selective_recompute``, what each adds to the
  layer's backward, ``recompute_forward`` and ``selective_forward`` what each adds to its forward,
  timed alone and in windows (``profile_recompute``);
* ``host_bandwidth_gbs`` (CUDA only, per file): GB/s each way between the device and pinned host
  memory with both directions copying at once (``host_link``), what the planner times activation
  offload's copies at;
* ``activation_for_weight`` (CUDA only): what the allocator still holds per micro-batch after
  the layer's ``I`` pieces (the input gradients they returned let go), i.e. what waits for ``W``: the runtime keeps the
  retained graph or the deferred GEMMs' inputs and output gradients, which can exceed the
  forward's activation;
* ``workspace`` (CUDA only): the allocator's peak during the layer's forwards and backwards above
  what was allocated before (gradients included) and the micro-batches' activations, i.e.
  temporaries such as a loss's float32 logits or a weight gradient on its way into ``.grad``.

Times in context. A stage runs its layers back to back, and a layer timed alone is not the same
layer timed in a stage: the first kernels of each timed run wait for the host, the last ones
leave the GPU idle before the closing event, and the host's launches for one layer overlap the
GPU's work on the previous one only inside a chain. Summing lone layers over-predicted a 1F1B
step of 6-block stages (measured: docs/planning.md). So after the lone measurements the
layers are also timed in windows of ``context`` consecutive layers, each window run as one stage
(the same ``StageRunner``, the same repeats), and every layer's times are scaled by its
window's ratios (window measured / sum of its layers measured alone; one ratio for the forward,
one for the full backward, one shared by ``I`` and ``W``): the lone runs give the split among the
window's layers, the window gives their sum as a stage sees it. ``I`` and ``W`` share a ratio
because a window may split them differently from a stage that holds only some of its layers: a
window that starts at the embedding has no input gradient to compute, so its ``I`` is nearly
empty and its ``W`` does the rest, while a stage starting at its third layer still needs the
full ``I``. The ratios are recorded under ``meta["context"]``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from pipetrain.planner.costs_file import LayerCost, ModelCosts, save_costs
from pipetrain.runtime.named_layers import Stage, context_windows
from pipetrain.runtime.profile import host_link, profile_replay
from pipetrain.runtime.profile.profile_clock import Clock, DeviceClock, clock_for
from pipetrain.runtime.profile.profile_memory import (
    GIB,
    OPTIMIZER_STATES,
    OPTIMIZER_TEMPORARIES,
    SavedBytes,
    checkpointed_bytes,
    static_bytes,
)
from pipetrain.runtime.profile.profile_recompute import StageTimer, recompute_times
from pipetrain.runtime.stage import StageRunner, leaves

#: the CPU transfer model: gloo send/recv over loopback
CPU_LATENCY_MS = 0.05
CPU_BANDWIDTH = 2e9  # bytes per second
#: the costs file's name of each timed piece -> its key while measuring
PIECES = {
    "forward": "forward",
    "backward": "backward",
    "backward_input": "i",
    "backward_weight": "w",
}
#: which ratio scales each time the windows scale: I and W share the split backward's; an eager
#: GPU profile's host and device times (``runtime.profile.profile_clock``) have ratios of their own
RATIO_OF = {
    f"{worker}{name}": f"{worker}{ratio}"
    for worker in ("", "host_", "device_")
    for name, ratio in (
        ("forward", "forward"),
        ("backward", "backward"),
        ("backward_input", "split_backward"),
        ("backward_weight", "split_backward"),
    )
}
TIMES = tuple(RATIO_OF)


def profile(
    layers: Sequence[nn.Module] | Mapping[str, nn.Module],
    sample_input: torch.Tensor | tuple[torch.Tensor, ...],
    *,
    loss_fn: Callable | None = None,
    target: object = None,
    optimizer: str = "adamw",
    repeats: int = 5,
    warmup: int = 2,
    in_flight: int = 4,
    context: int = 4,
    names: Sequence[str] | None = None,
    path: str | Path | None = None,
    meta: dict | None = None,
    timing: str = "wall",
) -> ModelCosts:
    """Measure every layer (see the module docstring); write the costs file to ``path`` if given.

    ``layers``: in call order, a sequence or, as ``pipetrain.split`` takes them, a mapping
    name -> layer (``nn.ModuleDict`` included) whose names become the layers' names.

    ``sample_input`` is one micro-batch, already on the layers' device. With ``loss_fn``, the last
    layer's output goes through ``loss_fn(output, target)`` and its backward starts from that
    loss; without, from a random output gradient (as every other layer's does). ``context``:
    layers per window timed as one stage to scale the lone times (1: no windows). ``timing``:
    ``"wall"`` (an eager step's times, host waits included) or ``"device"`` (the device's busy
    time alone, what a step replayed as a CUDA graph pays; CUDA only): ``runtime.profile.profile_clock``.
    """
    if isinstance(layers, Mapping | nn.ModuleDict):
        if names is not None:
            raise ValueError("layers is a mapping name -> layer; do not pass names= as well")
        names, layers = list(layers.keys()), list(layers.values())
    _check_arguments(layers, optimizer, repeats, warmup, in_flight, context, names)
    inputs = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    device = inputs[0].device
    clock = clock_for(device, timing)
    if isinstance(clock, DeviceClock) or clock.issue_times:
        profile_replay.calibrate(clock, layers, inputs, context, in_flight)
    rounds = (repeats, warmup, in_flight)
    measured, layer_inputs = _measure_layers(
        layers, inputs, loss_fn, target, clock, rounds, optimizer, names
    )
    windows = _scale_by_windows(
        layers, measured, layer_inputs, context, loss_fn, target, clock, rounds
    )
    timer = StageTimer(_measure, clock, rounds, loss_fn, target, len(layers))
    paid, paid_windows = recompute_times(layers, layer_inputs, context, timer)
    measured = [
        dataclasses.replace(
            x,
            recompute=paid["recompute"][i],
            selective_recompute=paid["selective_recompute"][i],
            recompute_forward=paid["recompute_forward"][i],
            selective_forward=paid["selective_forward"][i],
        )
        for i, x in enumerate(measured)
    ]
    costs = ModelCosts(
        layers=tuple(measured),
        comm=max((layer.comm or 0.0) for layer in measured),
        host_bandwidth_gbs=host_link.link_gbs(device, repeats=repeats) if clock.cuda else None,
        meta={
            "device": _device_name(device),
            "optimizer": optimizer,
            "repeats": repeats,
            "timing": timing,
            **_clock_meta(clock),
            "comm_method": _comm_method(device),
            **({"host_bandwidth": host_link.METHOD} if clock.cuda else {}),
            "torch": torch.__version__,
            "context": {"layers": context, "windows": windows, "recompute": paid_windows},
            **(meta or {}),
        },
    )
    if path is not None:
        save_costs(costs, path)
    return costs


def _clock_meta(clock: Clock) -> dict[str, object]:
    """What the costs file's ``meta`` says of how the clock was calibrated."""
    if isinstance(clock, DeviceClock):
        return {
            "replay_gap_us": clock.replay_gap_us,
            "replay_gap_on": clock.gap_measured_on,
            "sustained_slowdown": clock.sustained,
        }
    if clock.issue_times:
        return {
            "sustained_slowdown": clock.sustained,
            "sustained_on": clock.sustained_on,
            "queued_late": clock.late,
        }
    return {}


def _check_arguments(
    layers: Sequence[nn.Module],
    optimizer: str,
    repeats: int,
    warmup: int,
    in_flight: int,
    context: int,
    names: Sequence[str] | None,
) -> None:
    if not layers:
        raise ValueError("profile needs at least one layer")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; legal: {', '.join(OPTIMIZER_STATES)}")
    if repeats < 1 or warmup < 0 or in_flight < 1 or context < 1:
        raise ValueError(
            f"repeats, in_flight and context must be >= 1 and warmup >= 0, got {repeats}, "
            f"{in_flight}, {context} and {warmup}"
        )
    if names is not None and len(names) != len(layers):
        raise ValueError(f"{len(names)} names for {len(layers)} layers")


def _measure_layers(
    layers: Sequence[nn.Module],
    inputs: tuple[torch.Tensor, ...],
    loss_fn: Callable | None,
    target: object,
    clock: Clock,
    rounds: tuple[int, int, int],
    optimizer: str,
    names: Sequence[str] | None,
) -> tuple[list[LayerCost], list[tuple[torch.Tensor, ...]]]:
    """Every layer measured alone, each fed the previous one's output; also each layer's input
    (the windows start from them)."""
    seen: set[int] = set()
    measured = []
    layer_inputs = []
    for index, layer in enumerate(layers):
        layer_inputs.append(inputs)
        is_last = index == len(layers) - 1 and loss_fn is not None
        runner = StageRunner(index, layer, is_last, loss_fn if is_last else None)
        args = leaves(inputs)
        cost, outputs = _measure(runner, args, target, clock, *rounds)
        static, trained = static_bytes(layer, seen, OPTIMIZER_STATES[optimizer])
        comm = _transfer_ms(outputs, clock, rounds[0]) if outputs else 0.0
        name = names[index] if names is not None else f"{index}:{type(layer).__name__}"
        kept = {
            m: checkpointed_bytes(index, layer, is_last, loss_fn, args, target, m) / GIB
            for m in ("full", "selective")
        }
        measured.append(
            LayerCost(
                name=name,
                params=static / GIB,
                comm=comm,
                recompute_activation=kept["full"],
                optimizer_workspace=trained * OPTIMIZER_TEMPORARIES[optimizer] / GIB,
                selective_activation=kept["selective"],
                **cost,  # type: ignore[arg-type]
            )
        )
        with torch.no_grad():
            out = layer(*inputs)
        inputs = out if isinstance(out, tuple) else (out,)
    return measured, layer_inputs


def _scale_by_windows(
    layers: Sequence[nn.Module],
    measured: list[LayerCost],
    layer_inputs: list[tuple[torch.Tensor, ...]],
    context: int,
    loss_fn: Callable | None,
    target: object,
    clock: Clock,
    rounds: tuple[int, int, int],
) -> list[dict]:
    """Scale ``measured`` in place by each window's ratios; the windows, for ``meta``."""
    windows = []
    for span in context_windows(len(layers), context):
        first, end = span.start, span.stop
        ratios = _window_ratios(
            layers, measured, layer_inputs[first], first, end, loss_fn, target, clock, rounds
        )
        for i in range(first, end):
            scaled = {
                k: getattr(measured[i], k) * ratios[RATIO_OF[k]]
                for k in TIMES
                if RATIO_OF[k] in ratios
            }
            measured[i] = dataclasses.replace(measured[i], **scaled)
        windows.append({"first": first, "end": end, **ratios})
    return windows


def _window_ratios(
    layers, measured, inputs, first: int, end: int, loss_fn, target, clock, rounds
) -> dict[str, float]:
    """Layers ``first..end-1`` timed as one stage: measured / sum of their lone times, for the
    forward, the full backward and the split backward (``I + W``), and for the host's and the
    device's where they were measured."""
    is_last = end == len(layers) and loss_fn is not None
    chain = Stage([(f"layer{i}", layers[i]) for i in range(first, end)])
    runner = StageRunner(first, chain, is_last, loss_fn if is_last else None)
    window, _ = _measure(runner, leaves(inputs), target, clock, *rounds)
    ratios = {}
    for ratio in dict.fromkeys(RATIO_OF.values()):  # forward, backward, split_backward, ...
        parts = [k for k in TIMES if RATIO_OF[k] == ratio]
        if any(window.get(k) is None for k in parts):
            continue
        alone = sum(getattr(measured[i], k) for i in range(first, end) for k in parts)
        ratios[ratio] = sum(window[k] for k in parts) / alone if alone > 0 else 1.0
    return ratios


def _measure(
    runner: StageRunner,
    args,
    target,
    clock: Clock,
    repeats: int,
    warmup: int,
    in_flight: int,
    split: bool = True,
    issue: bool = True,
):
    """The stage's times (the split backward's ``I`` and ``W`` only with ``split``; the host's
    and the device's where the clock splits them and ``issue``), saved bytes and workspace, and
    its outputs."""
    saved, outputs, grads = _first_pass(runner, args, target)
    mbs = range(in_flight)

    def forwards() -> None:
        for mb in mbs:
            runner.forward(mb, args, target, 1.0)  # the output is sent and let go

    def run(step) -> None:
        for mb in mbs:
            step(mb)

    times: dict[str, list[float]] = {}
    split_times = issue and clock.issue_times
    passes = ("wall", "queued") if split_times else ("wall",)
    workspace = for_weight = 0.0
    for rep in range(warmup + repeats):
        host: dict[str, float] = {}  # this round's issue times: how far the queued pass leads
        for how in passes:
            for piecewise in (False, True) if split else (False,):
                runner.begin_step()
                before = _allocated(clock)
                pieces = [("forward", forwards)] + (
                    [
                        ("i", lambda: run(lambda mb: _discard(runner.backward_input(mb, grads)))),
                        ("w", lambda: run(runner.backward_weight)),
                    ]
                    if piecewise
                    else [
                        ("backward", lambda: run(lambda mb: _discard(runner.backward(mb, grads))))
                    ]
                )
                for key, fn in pieces:
                    if how == "queued":
                        sample = {f"device_{key}": clock.queued(fn, host[key])}
                    else:
                        wall, host[key], _ = clock.issue(fn)
                        sample = {key: wall, **({f"host_{key}": host[key]} if split_times else {})}
                    if key == "i" and clock.cuda:  # what W still needs
                        held = (torch.cuda.memory_allocated() - before) / in_flight
                        for_weight = max(for_weight, held)
                    if rep >= warmup and not (piecewise and key == "forward"):
                        for k, v in sample.items():
                            times.setdefault(k, []).append(v / in_flight)
                if clock.cuda:
                    peak = torch.cuda.max_memory_allocated() - before - in_flight * saved.bytes
                    workspace = max(workspace, peak)

    return _summary(times, split_times, saved, workspace, for_weight, clock), outputs


def _summary(
    times: dict[str, list[float]],
    split_times: bool,
    saved: SavedBytes,
    workspace: float,
    for_weight: float,
    clock: Clock,
) -> dict[str, float | None]:
    """A stage's measured times (medians of the rounds), its activation and workspace, in the
    costs file's names and units."""

    def med(key: str) -> float | None:
        return statistics.median(times[key]) if key in times else None

    by_worker = (
        {
            f"{w}_{name}": med(f"{w}_{key}")
            for w in ("host", "device")
            for name, key in PIECES.items()
        }
        if split_times
        else {}
    )
    return {
        **{name: med(key) for name, key in PIECES.items()},
        **by_worker,
        "activation": saved.bytes / GIB,
        "workspace": workspace / GIB,
        "activation_for_weight": for_weight / GIB if clock.cuda else None,
    }


def _first_pass(runner: StageRunner, args, target) -> tuple[SavedBytes, tuple, list | None]:
    """One untimed forward and backward: what the forward saves (counted here, outside the timed
    runs, as the hooks cost host time), its outputs, and the output gradients later backwards
    start from (random; none for the last layer, whose backward starts from the loss)."""
    runner.begin_step()
    saved = SavedBytes(runner.module)
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        outputs = runner.forward(0, args, target, 1.0)
    grads = None
    if not runner.is_last:
        grads = [
            torch.randn(m.shape, dtype=m.dtype, device=outputs[0].device)
            for m in runner.grad_metas(0)
        ]
    runner.backward(0, grads)
    # A training loop keeps .grad between steps (zero_grad(set_to_none=False)): later backward
    # pieces add into it, through temporaries the workspace must count.
    for p in runner.params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return saved, outputs, grads


def _discard(_: object) -> None:
    """Input gradients a pipeline would send upstream and let go."""


def _allocated(clock: Clock) -> int:
    if not clock.cuda:
        return 0
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _transfer_ms(outputs: tuple[torch.Tensor, ...], clock: Clock, repeats: int) -> float:
    nbytes = sum(o.numel() * o.element_size() for o in outputs)
    if not clock.cuda:
        return CPU_LATENCY_MS + nbytes / CPU_BANDWIDTH * 1e3
    here = outputs[0].device
    there = torch.device("cuda", (here.index or 0) + 1) if torch.cuda.device_count() > 1 else here
    sources = [o.detach() for o in outputs]
    dests = [torch.empty_like(o, device=there) for o in sources]

    def copy() -> None:
        for d, s in zip(dests, sources):
            d.copy_(s, non_blocking=True)

    copy()
    times = [clock.time(copy)[0] for _ in range(repeats)]
    return statistics.median(times)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return str(device)


def _comm_method(device: torch.device) -> str:
    if device.type != "cuda":
        return f"model: {CPU_LATENCY_MS} ms + bytes / {CPU_BANDWIDTH:g} B/s"
    if torch.cuda.device_count() > 1:
        return "measured: copy to the next GPU (peer-to-peer)"
    return "measured: device-to-device copy on one GPU (lower bound)"
