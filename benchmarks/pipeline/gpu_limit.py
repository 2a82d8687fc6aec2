"""The physical limit for ``gpu_pipeline.py`` (each rank's own layers, no pipeline, no
communication), the bytes a stage holds after F and after I, and a one-way P2P time.
"""

from __future__ import annotations

import copy
import gc
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.gpu_setup import (
    GIB,
    Ctx,
    local_stages,
    make_optimizer,
    opt_step,
    slowest,
    stats,
    time_steps,
)
from pipetrain.app.models.gpt import lm_loss

# ---------------------------------------------------------------------------------------------
# the physical limit and a P2P estimate
# ---------------------------------------------------------------------------------------------


def measure_limit(ctx: Ctx, layout: str, v: int, n: int) -> dict:
    num_stages = v * ctx.world
    mine = local_stages(layout, ctx.rank, ctx.world, v)
    base = ctx.mem_reset()
    mods = {s: ctx.stage(num_stages, s) for s in mine}
    params = [p for m in mods.values() for p in m.parameters()]
    opt = make_optimizer(ctx, params)
    x, y = ctx.batch(n)
    xs, ys = x.chunk(n), y.chunk(n)
    b, t, h = ctx.args.mb_size, ctx.cfg.seq_len, ctx.cfg.hidden
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    hid = torch.randn(b, t, h, device=ctx.device, dtype=ctx.dtype, generator=gen)
    gout = torch.randn(b, t, h, device=ctx.device, dtype=ctx.dtype, generator=gen) * 1e-3
    act: dict[int, int] = {}
    held = measure_held(ctx, mods, num_stages, xs[0], ys[0], hid, gout, 1.0 / n, None)
    held_replay = measure_held(ctx, mods, num_stages, xs[0], ys[0], hid, gout, 1.0 / n, False)

    def step() -> None:
        for j in range(n):
            for s in mine:
                inp = xs[j] if s == 0 else hid.detach().requires_grad_()
                before = ctx.mem_now() if j == 0 and s not in act else None
                out = mods[s](inp)
                if s == num_stages - 1:
                    loss = lm_loss(out, ys[j]) / n
                    if before is not None:
                        act[s] = ctx.mem_now() - before
                    loss.backward()
                else:
                    if before is not None:
                        act[s] = ctx.mem_now() - before
                    out.backward(gout)
                del out
        opt_step(opt, params)

    for _ in range(ctx.args.limit_warmup):
        step()
    times = slowest(ctx, time_steps(ctx, step, ctx.args.limit_steps))
    peak = (ctx.mem_peak() or 0) - base if ctx.cuda else None
    acts: dict[int, int] = {}
    for part in ctx.gather(act):
        acts.update(part)
    after_f: dict[int, int] = {}
    after_i: dict[int, int] = {}
    transient: dict[int, int] = {}
    for part in ctx.gather(held):
        for k, (f_bytes, i_bytes, t_bytes) in part.items():
            if f_bytes is not None:
                after_f[k], after_i[k], transient[k] = f_bytes, i_bytes, t_bytes
    after_i_r: dict[int, int] = {}
    transient_r: dict[int, int] = {}
    for part in ctx.gather(held_replay):
        for k, (f_bytes, i_bytes, t_bytes) in part.items():
            if f_bytes is not None:
                after_i_r[k], transient_r[k] = i_bytes, t_bytes
    out = stats(times)
    out.update(
        layout=layout,
        stages_per_rank=v,
        microbatches=n,
        tokens_per_s=n * b * t / (out["median_ms"] / 1e3),
        activation_bytes={str(k): v for k, v in sorted(acts.items())},
        runtime_after_forward_bytes={str(k): v for k, v in sorted(after_f.items())},
        runtime_after_input_bytes={str(k): v for k, v in sorted(after_i.items())},
        transient_bytes={str(k): v for k, v in sorted(transient.items())},
        replay_after_input_bytes={str(k): v for k, v in sorted(after_i_r.items())},
        replay_transient_bytes={str(k): v for k, v in sorted(transient_r.items())},
        peak_gib_rank0=None if peak is None else peak / GIB,
    )
    return out


def measure_held(
    ctx: Ctx,
    mods: dict,
    num_stages: int,
    x0,
    y0,
    hid,
    gout,
    weight: float,
    defer_weight_grads: bool | None = None,
) -> dict[int, tuple[int | None, int | None, int | None]]:
    """Per local stage: bytes the runtime holds for one micro-batch after its F and after its I,
    and the transient: how far the allocator's peak during that F, I and W rose above the larger
    of the two (workspace no schedule keeps: e.g. the last stage's float32 logits in the loss).
    ``.grad`` is allocated first, as it is in every step of a run after the first, so the
    transient does not count the gradients' first allocation.

    One micro-batch through pipetrain's own ``StageRunner`` (the object the runtime keeps per
    stage, with the runtime's I/W split),
    measured as ``memory_allocated`` minus the value before F. As in the runtime, the received
    input and the received output gradient are fresh buffers allocated after that point, the
    stage's outputs and the input gradients are dropped once produced (the runtime sends them and
    keeps only gradient edges), so after F the graph's saved tensors remain, and after I (before
    W) what W still needs. ``(None, None, None)`` per stage without CUDA (no allocator statistics).

    ``defer_weight_grads`` as ``Pipeline``'s (default: deferred linear weight GEMMs on these
    stages, so after I they hold the linears' inputs and output gradients and the graph is gone;
    ``False``: graph replay). Measured on deep copies of ``mods`` (deferral changes module classes,
    and the limit run times plain ``nn.Linear``). The micro-batch is measured as one that is not
    the step's last weight piece (that one also holds its other parameters' gradients for
    ``AccumulateGrad``).
    """
    from pipetrain.runtime.stage import StageRunner

    held: dict[int, tuple[int | None, int | None, int | None]] = {}
    for s, original in mods.items():
        mod = copy.deepcopy(original)
        last = s == num_stages - 1
        runner = StageRunner(s, mod, last, lm_loss, defer_weight_grads)
        runner.last_weight_microbatch = -1  # micro-batch 0 is not the step's last weight piece
        for p in mod.parameters():  # as in a run's steps: .grad exists (else W allocates it)
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        gc.collect()
        before = ctx.mem_now()
        if ctx.cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        inp = x0 if s == 0 else hid.clone().requires_grad_()  # the receive buffer
        outputs = runner.forward(0, (inp,), y0, weight)
        del outputs, inp  # sent and released; the graph keeps what it saved
        after_f = ctx.mem_now()
        received = None if last else [gout.clone()]  # the gradient's receive buffer
        input_grads = runner.backward_input(0, received)
        del input_grads, received  # sent and released
        after_i = ctx.mem_now()
        runner.backward_weight(0)
        peak = ctx.mem_peak()
        if runner.leftovers():
            raise RuntimeError(f"stage {s}: StageRunner kept {runner.leftovers()} micro-batches")
        del runner, mod
        if before is None or peak is None:
            held[s] = (None, None, None)
        else:
            f_bytes, i_bytes = after_f - before, after_i - before  # type: ignore[operator]
            held[s] = (f_bytes, i_bytes, max(0, peak - before - max(f_bytes, i_bytes)))
    return held


def measure_comm_ms(ctx: Ctx) -> float | None:
    """One-way time of one activation between ranks 0 and 1 (ping-pong, blocking send/recv)."""
    if ctx.world < 2:
        return None
    shape = (ctx.args.mb_size, ctx.cfg.seq_len, ctx.cfg.hidden)
    buf = torch.zeros(shape, dtype=ctx.dtype, device=ctx.device)
    reps = 10

    def ping(count: int) -> None:
        for _ in range(count):
            if ctx.rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            elif ctx.rank == 1:
                dist.recv(buf, 0)
                dist.send(buf, 0)

    ping(3)
    ctx.barrier()
    ctx.sync()
    t = time.perf_counter()
    ping(reps)
    ctx.sync()
    ms = (time.perf_counter() - t) * 1e3 / (2 * reps)
    return ctx.agree(ms)
