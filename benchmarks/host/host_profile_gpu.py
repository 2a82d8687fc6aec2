"""Where the host time of ``B``, ``I`` and ``W`` goes, for one transformer block on a GPU.

    python benchmarks/host/host_profile_gpu.py [--out DIR]

A diagnostic, not a target: the split backward's device time is already that of ``B``
(``split_backward_gpu.py``), but with few layers per stage the host issues a block's ``I`` and
``W`` slower than the GPU runs them. This prints

* the host cost of one bare autograd engine call on this device (a one-node graph), which each
  ``W`` pays once per parameter group;
* per piece (``F``, ``B``, ``I``, ``W``; ``Fd``, ``Id``, ``Wd`` with the linears deferred), host
  ms, the number of engine calls, of aten ops and of kernel launches, and the top ops by host
  time (``torch.profiler``), with the GPU kept busy so the host never waits for it.

The pieces are a ``BackwardSplit``'s methods on one block, as the runtime's ``StageRunner`` calls
them for a micro-batch that is not the step's last weight piece: ``graph_replay.GraphReplay``
(``F``, ``B``, ``I``, ``W``) and ``deferred_wgrad.DeferredLinears`` (``Fd``, ``Id``, ``Wd``:
``Pipeline(defer_weight_grads=True)``'s split).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from torch.autograd.graph import get_gradient_edge

from benchmarks.runtime.split_backward_gpu import block_arguments, make
from pipetrain.app.models.gpt import GPTConfig
from pipetrain.runtime.backward.deferred_wgrad import DeferredLinears
from pipetrain.runtime.backward.graph_replay import GraphReplay


def host_ms(fn, reps: int, cuda: bool) -> float:
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(50_000_000)
        fn()  # warm the host, then time
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    block_arguments(p, reps=30)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = GPTConfig(hidden=a.hidden, num_heads=a.heads, seq_len=a.seq, num_layers=1)
    block, x, g = make(cfg, dev, dtype, a.batch)
    params = [q for q in block.parameters() if q.requires_grad]
    sb = GraphReplay()
    dw = DeferredLinears(block)  # Fd / Id / Wd: Pipeline(defer_weight_grads=True)'s split
    result: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu"}

    # one bare engine call: y = 2 * t, grad of t
    t = torch.ones(4, device=dev, requires_grad=True)
    gy = torch.ones(4, device=dev)

    def bare():
        (t * 2).backward(gy)

    result["bare_engine_call_ms"] = host_ms(bare, 200, cuda)

    state: dict = {}

    def fwd():
        xi = x.detach().requires_grad_()
        out = sb.call(block, (xi,))
        state.update(xi=xi, roots=[get_gradient_edge(out)])

    def b():
        sb.backward_full(state["roots"], [g], [state["xi"]], params, hooks=False)

    def i():
        state["work"] = sb.backward_input(state["roots"], [g], [state["xi"]], params)[1]

    def w():
        sb.backward_weight(state["work"], hooks=False)
        state.pop("work")

    def fwd_d():
        xi = x.detach().requires_grad_()
        out = dw.call(block, (xi,))
        state.update(xi=xi, roots=[get_gradient_edge(out)])

    def i_d():
        roots, xi = state["roots"], state["xi"]
        state["work"] = dw.backward_input(roots, [g], [xi], params, last_piece=False)[1]

    def w_d():
        dw.backward_weight(state["work"], hooks=False)
        state.pop("work")

    pieces = {"F": fwd, "B": b, "I": i, "W": w, "Fd": fwd_d, "Id": i_d, "Wd": w_d}
    # Bursts of back-to-back micro-batches behind one long sleep kernel: the GPU never catches
    # up, and timing skips each burst's first micro-batch (a host that just woke up from a
    # synchronize runs slow: clocks, caches), so these are a busy host's launch costs.
    times: dict[str, list[float]] = {k: [] for k in pieces}
    for burst in range(a.reps // 5 + 1):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)
        for r in range(6):
            for name in ("F", "B", "F", "I", "W", "Fd", "Id", "Wd"):
                t0 = time.perf_counter()
                pieces[name]()
                if burst and r:
                    times[name].append((time.perf_counter() - t0) * 1e3)
    result["host_ms"] = {k: statistics.median(v) for k, v in times.items()}
    profile_each(pieces, state, cuda, result)
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "host_profile.json").write_text(json.dumps(result, indent=1))
    return 0


def profile_each(pieces: dict, state: dict, cuda: bool, result: dict) -> None:
    """One profiled call of each piece with the GPU kept busy: its aten ops, kernel launches,
    autograd nodes and busiest host operators, into ``result["profile"]``."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    result["profile"] = {}
    for seq in (("F", "B"), ("F", "I", "W"), ("Fd", "Id", "Wd")):
        for name in seq:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda._sleep(200_000_000)
            with profile(activities=acts) as prof:
                pieces[name]()
            if name == "I":
                result["groups_per_block"] = len(state["work"].groups)
            ev = prof.key_averages()
            ops = [e for e in ev if e.key.startswith("aten::")]
            launches = sum(e.count for e in ev if "LaunchKernel" in e.key or "cudaLaunch" in e.key)
            engine = sum(e.count for e in ev if "autograd::engine::evaluate_function" in e.key)
            top = sorted(ev, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
            result["profile"][name] = {
                "aten_ops": sum(e.count for e in ops),
                "kernel_launches": launches,
                "autograd_nodes": engine,
                "top_self_cpu_us": [
                    f"{e.key[:50]} x{e.count}: {e.self_cpu_time_total:.0f}" for e in top
                ],
            }


if __name__ == "__main__":
    sys.exit(main())
