"""pipetrain against torch.distributed.pipelining on real GPUs (docs/benchmarks.md); a benchmark.

    torchrun --nproc-per-node 2 benchmarks/pipeline/gpu_pipeline.py --out $OUT            # 2 GPUs, NCCL
    torchrun --nproc-per-node 4 benchmarks/pipeline/gpu_pipeline.py --out $OUT            # 4 GPUs, NCCL
    torchrun --nproc-per-node 4 benchmarks/pipeline/gpu_pipeline.py --preset cpu-smoke   # CPU, gloo

Per configuration (schedule family × micro-batch count) both libraries train the same GPT
(``pipetrain.app.models.gpt``; stages deep-copied from one seeded master, so the weights are equal and
nothing is shared) on the same ranks, micro-batch size and count, with the same optimizer step
(AdamW foreach, ``zero_grad(set_to_none=False)``). The libraries alternate: pipetrain first on even
configurations, torch first on odd ones. Each runs warm-up steps, then timed steps
(``synchronize`` + ``perf_counter`` around the whole step including the optimizer, after a
barrier; a step's time is the slowest rank's), and pipetrain then runs ``timeline=True`` steps
*after* the timed ones, so event recording never pollutes the step times.

Reported per configuration and library: step time (median, min–max), tokens/s, model TFLOP/s per
GPU, peak GPU memory per rank (``max_memory_allocated`` above what was allocated before the
library's modules were built), pipeline efficiency = limit step time / step time. For pipetrain
also: the measured bubble fraction (from its measured timeline), the simulator's bubble from the
measured mean F/B/I/W/pair time per stage with comm = 0 and with comm = a measured one-way P2P time
of one activation (ping-pong between ranks 0 and 1), and the predicted peak memory: resident state
before the step + the simulator's activation peak, with ``activation`` = the bytes one
micro-batch's forward allocated in the limit run and ``activation_for_weight`` = the bytes
pipetrain's ``StageRunner`` still holds after that micro-batch's I, before its W (by default the
deferred linears' inputs and output gradients; with graph replay the retained graph + gradients
captured for W), measured per stage in the limit run (``measure_held``). "pred GiB + workspace"
(``pred_peak_gib_with_workspace``) also gives the simulator each stage's workspace
(``Costs.workspace``: how far one micro-batch's F, I and W alone took the allocator's peak above
what they hold, e.g. the loss's float32 logits), held only while that stage's actions run
(``gpu_memory.py``).

``pipetrain`` rows run ``Pipeline``'s defaults (on this GPT: deferred linear weight GEMMs, see
``pipetrain.runtime.backward.deferred_wgrad``); ``pipetrain-replayw`` rows (``--replay-schedules``) run
``defer_weight_grads=False``, the graph-replay split; ``pipetrain-overlap`` rows
(``--overlap-schedules``) run ``overlap_pairs=True``. Every row is configured through ``Pipeline``'s
public arguments.

The physical limit: every rank runs its own stages of the same layout with no pipeline and no
communication — for each micro-batch, forward and ordinary backward of each local stage (random
activations in, random gradients out), then the same optimizer step — all ranks concurrently. The
pipeline cannot beat the slowest rank's time, so limit step time = max over ranks of the median;
limit tokens/s = batch tokens / that time (per-rank work scaled by the number of ranks).

Model FLOPs per token = 6·P + 12·L·s·h, P = parameters except the embeddings (blocks, final LN,
head), L layers, s sequence length, h hidden (the attention term counts QKᵀ and AV, forward and
backward, without halving for the causal mask: the PaLM/Megatron convention).

Every failure becomes an error row and the run goes on; a time budget skips what would not fit.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.gpu_setup import (
    FAMILIES,
    GIB,
    PRESETS,
    Ctx,
    Family,
    GcPauses,
    allocator_counts,
    clock_stamp,
    flops_per_token,
    local_stages,
    log,
    make_optimizer,
    make_pipeline,
    opt_step,
    slowest,
    stats,
    time_steps,
)
from benchmarks.pipeline.gpu_limit import measure_comm_ms, measure_limit
from benchmarks.pipeline.gpu_memory import predicted_peaks
from benchmarks.pipeline.gpu_report import (
    OVERLAP,
    REPLAY,
    host_bound_fraction,
    plot,
    save_timeline_text,
    short,
    table,
    write_json,
)
from pipetrain.app.models.gpt import lm_loss
from pipetrain.sim.costs import mean_durations, measured_costs
from pipetrain.sim.simulate import simulate

# ---------------------------------------------------------------------------------------------
# the two libraries
# ---------------------------------------------------------------------------------------------


def measure(ctx: Ctx, pipeline_step, opt, params, base: int) -> tuple[dict, int | None]:
    """Warm up, then time ``pipeline_step`` + the optimizer step; memory above ``base``.

    Returns the row (times; ``peak_gib``: per rank, the peak during the pipeline step alone;
    ``peak_total_gib``: including the optimizer step's temporaries; ``peak_reserved_gib``: the
    caching allocator's reserved peak, optimizer included) and the memory resident before a
    step (parameters, gradients, optimizer state, library buffers), above ``base``.

    Reserved memory is the footprint a library cannot hand back: a block freed while another
    stream still uses it (a tensor sent by NCCL, released before the send finished, as
    Megatron's ``deallocate_pipeline_outputs`` does) leaves the allocated count at once but
    stays unusable, and reserved, until that stream passes it.
    """
    peaks = {"step": 0, "total": 0, "reserved": 0}

    def step() -> None:
        if ctx.cuda:
            peaks["total"] = max(peaks["total"], torch.cuda.max_memory_allocated(ctx.device))
            peaks["reserved"] = max(peaks["reserved"], torch.cuda.max_memory_reserved(ctx.device))
            torch.cuda.reset_peak_memory_stats(ctx.device)
        pipeline_step()
        if ctx.cuda:
            peaks["step"] = max(peaks["step"], torch.cuda.max_memory_allocated(ctx.device))
        opt_step(opt, params)

    for _ in range(ctx.args.warmup):
        step()
    ctx.sync()
    resident = None if not ctx.cuda else torch.cuda.memory_allocated(ctx.device) - base
    peaks.update(step=0, total=0, reserved=0)
    pauses = GcPauses()
    timed_from = clock_stamp()  # the timed steps alone, for their clock (incumbents_clocks)
    times = time_steps(ctx, step, ctx.args.steps, pauses)
    timed_to = clock_stamp()
    row = stats(slowest(ctx, times)) | {"timed_from": timed_from, "timed_to": timed_to}
    row["gc_pause_ms"] = [round(1e3 * t, 3) for t in slowest(ctx, pauses.per_step)]
    if ctx.cuda:
        peaks["total"] = max(peaks["total"], torch.cuda.max_memory_allocated(ctx.device))
        peaks["reserved"] = max(peaks["reserved"], torch.cuda.max_memory_reserved(ctx.device))
        row["peak_gib"] = gathered_gib(ctx, peaks["step"] - base)
        row["peak_total_gib"] = gathered_gib(ctx, peaks["total"] - base)
        row["peak_reserved_gib"] = gathered_gib(ctx, peaks["reserved"] - base)
        row["resident_gib"] = gathered_gib(ctx, resident)
    return row, resident


def run_pipetrain(
    ctx: Ctx,
    name: str,
    fam: Family,
    n: int,
    limit: dict,
    comm_ms,
    lib: str = "pipetrain",
) -> dict:
    """One configuration of pipetrain; ``lib`` names a variant (OVERLAP, REPLAY)."""
    overlap = lib == OVERLAP
    replay = lib == REPLAY
    a = ctx.args
    num_stages = fam.stages_per_rank * ctx.world
    base = ctx.mem_reset()
    pipe = make_pipeline(
        ctx,
        name,
        n,
        a.op_timeout,
        overlap_pairs=overlap,
        defer_weight_grads=False if replay else None,
    )
    expect = local_stages(fam.layout, ctx.rank, ctx.world, fam.stages_per_rank)
    got = sorted(pipe.placement.stages_of_rank(ctx.rank))
    if got != sorted(expect):
        raise RuntimeError(f"placement differs from torch's: pipetrain {got}, torch {expect}")
    params = list(pipe.parameters())
    opt = make_optimizer(ctx, params)
    x, y = ctx.batch(n)
    row, _ = measure(ctx, lambda: pipe.step(x, y), opt, params, base)
    timelines = []
    for _ in range(a.timeline_steps):
        pipe.step(x, y, timeline=True)
        timelines.append(pipe.last_timeline)
        opt_step(opt, params)
    if timelines:
        mean = mean_durations(timelines)
        acts = limit.get("activation_bytes") or {}
        act = [acts.get(str(s), 0) / GIB for s in range(num_stages)]
        sim0 = simulate(pipe.program, measured_costs(timelines, num_stages, activation=act))
        simc = simulate(
            pipe.program,
            measured_costs(timelines, num_stages, comm=comm_ms or 0.0, activation=act),
        )
        row.update(
            bubble_measured=statistics.fmean(t.bubble_fraction for t in timelines),
            bubble_host_bound=host_bound_fraction(timelines),
            makespan_measured_ms=statistics.fmean(t.makespan for t in timelines),
            bubble_sim_comm0=sim0.bubble_fraction,
            bubble_sim_comm=simc.bubble_fraction,
            makespan_sim_comm0_ms=sim0.makespan,
            makespan_sim_comm_ms=simc.makespan,
            mean_action_ms={f"{k.value}{s}": round(v, 4) for (k, s), v in sorted(mean.items())},
            timeline_peak_activations=list(timelines[-1].peak_activations),
        )
        res = row.get("resident_gib")
        if res and acts:
            # the F-only model (every activation held at its F size until its last backward)
            row["pred_peak_gib_f_only"] = [r + s for r, s in zip(res, simc.peak_activations)]
            row.update(predicted_peaks(pipe.program, mean, res, limit, comm_ms or 0.0, replay))
        if ctx.rank == 0 and a.out:
            save_timeline_text(ctx, name, n, timelines[-1], simc)
    return row


def gathered_gib(ctx: Ctx, value: int | None) -> list[float] | None:
    everyone = ctx.gather(value)
    if any(v is None for v in everyone):
        return None
    return [v / GIB for v in everyone]


def run_torch(ctx: Ctx, name: str, fam: Family, n: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    cls = getattr(S, fam.torch_class, None)
    if cls is None:
        return {"skipped": f"not in this torch ({torch.__version__}): {fam.torch_class}"}
    num_stages = fam.stages_per_rank * ctx.world
    mine = local_stages(fam.layout, ctx.rank, ctx.world, fam.stages_per_rank)
    base = ctx.mem_reset()
    mods = {s: ctx.stage(num_stages, s) for s in mine}
    stages = [PipelineStage(mods[s], s, num_stages, ctx.device) for s in mine]
    sched = cls(stages if fam.stages_per_rank > 1 else stages[0], n, loss_fn=lm_loss)
    params = [p for m in mods.values() for p in m.parameters()]
    opt = make_optimizer(ctx, params)
    x, y = ctx.batch(n)
    args = (x,) if 0 in mine else ()
    kwargs: dict = {}
    if num_stages - 1 in mine:
        kwargs["target"] = y
    if "return_outputs" in inspect.signature(sched.step).parameters:
        kwargs["return_outputs"] = False

    row, _ = measure(ctx, lambda: sched.step(*args, **kwargs), opt, params, base)
    return row


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def guarded(ctx: Ctx, what: str, fn) -> dict:
    """Run ``fn`` on every rank; any rank's exception makes an error row (all ranks agree). On
    CUDA the row also gets each rank's caching-allocator retries (the cache freed and the device
    synchronised to find memory) and ``cudaMalloc`` calls while ``fn`` ran."""
    t = time.perf_counter()
    before = allocator_counts(ctx.device)
    try:
        row, err = fn(), None
    except Exception as e:
        row, err = {}, f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if ctx.args.verbose:
            traceback.print_exc()
        ctx.mem_reset()
    counts = [a - b for a, b in zip(allocator_counts(ctx.device), before)]
    gathered = ctx.gather((err, counts))
    errors = [e for e, _ in gathered if e]
    if errors:
        row = {"error": errors[0]}
        log(ctx, f"{what}: ERROR {errors[0]}")
    if ctx.cuda:
        row["allocator_retries"] = [c[0] for _, c in gathered]
        row["device_allocs"] = [c[1] for _, c in gathered]
    row["wall_s"] = time.perf_counter() - t
    return row


def describe(ctx: Ctx, args: argparse.Namespace, fpt: float) -> dict:
    """The JSON's ``meta``: the machine, the model, the settings and what each number means."""
    cfg = ctx.cfg
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu",
        "backend": dist.get_backend(),
        "world": ctx.world,
        "model": {
            "vocab": cfg.vocab_size,
            "seq": cfg.seq_len,
            "layers": cfg.num_layers,
            "hidden": cfg.hidden,
            "heads": cfg.num_heads,
            "dtype": args.dtype,
        },
        "microbatch_size": args.mb_size,
        "optimizer": args.optimizer,
        "steps": args.steps,
        "warmup": args.warmup,
        "flops_per_token": fpt,
        "flops_formula": "6*P + 12*L*s*h; P = non-embedding parameters (blocks, final LN, head)",
        "limit": "max over ranks of the median step time of its own stages, no pipeline, "
        "gradient accumulation over the same micro-batches, same optimizer",
        "efficiency": "limit step time / step time",
        "argv": sys.argv,
    }
    meta["memory_model"] = (
        "resident before the step + simulated activation peak; activation = one micro-batch's "
        "forward bytes (limit run), activation_for_weight = bytes StageRunner holds after I"
    )
    return meta


def with_rates(res: dict, tokens: int, fpt: float, world: int, limit: dict) -> dict:
    """A measured row with its tokens/s, TFLOP/s per GPU and efficiency against the limit."""
    if "median_ms" in res:
        res["tokens_per_s"] = tokens / (res["median_ms"] / 1e3)
        res["tflops_per_gpu"] = fpt * tokens / (res["median_ms"] / 1e3) / world / 1e12
        if "median_ms" in limit:
            res["efficiency"] = limit["median_ms"] / res["median_ms"]
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ctx = Ctx(args)
    cfg = ctx.cfg
    n_list = [int(v) for v in args.microbatches.split(",") if v] or [2 * ctx.world]
    names = [s for s in args.schedules.split(",") if s]
    bad = [s for s in names if s not in FAMILIES]
    if bad:
        raise SystemExit(f"unknown schedules {bad}; legal: {', '.join(FAMILIES)}")
    out = Path(args.out) if args.out else None
    if out and ctx.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "timelines.txt").unlink(missing_ok=True)
    fpt = flops_per_token(cfg)
    meta = describe(ctx, args, fpt)
    log(ctx, f"gpu_pipeline: {meta['device']} × {ctx.world}, torch {torch.__version__}, {cfg}")
    comm_ms = guarded(ctx, "comm", lambda: {"ms": measure_comm_ms(ctx)}).get("ms")
    meta["comm_ms_one_way"] = comm_ms
    meta["comm_source"] = "measured ping-pong of one activation between ranks 0 and 1"
    log(ctx, f"one activation rank 0 → 1: {comm_ms} ms")
    limits: dict[tuple[str, int, int], dict] = {}
    rows: list[dict] = []
    config_s: dict[int, float] = {}
    index = 0
    for n in n_list:
        tokens = n * args.mb_size * cfg.seq_len
        for name in names:
            fam = FAMILIES[name]
            key = (fam.layout, fam.stages_per_rank, n)
            est = config_s.get(n, max(config_s.values(), default=0.0))
            skip = ctx.agree(ctx.elapsed() + est > args.budget_s)
            row = {"schedule": name, "microbatches": n, "tokens_per_step": tokens}
            if skip:
                row["skipped"] = f"time budget ({args.budget_s:.0f} s) would be exceeded"
                rows.append(row)
                log(ctx, f"{name} n={n}: skipped (time budget)")
                continue
            start = time.perf_counter()
            if key not in limits:
                limits[key] = guarded(
                    ctx,
                    f"limit {key}",
                    lambda f=fam, n=n: measure_limit(ctx, f.layout, f.stages_per_rank, n),
                )
                log(ctx, f"limit {key}: {limits[key].get('median_ms', 'n/a')} ms")
            limit = limits[key]
            order = ("pipetrain", "torch") if index % 2 == 0 else ("torch", "pipetrain")
            index += 1
            if name in args.overlap_schedules.split(","):
                order += (OVERLAP,)
            if name in args.replay_schedules.split(","):
                order += (REPLAY,)
            for lib in order:
                if lib.startswith("pipetrain"):
                    fn = functools.partial(run_pipetrain, ctx, name, fam, n, limit, comm_ms, lib)
                else:
                    fn = functools.partial(run_torch, ctx, name, fam, n)
                res = with_rates(
                    guarded(ctx, f"{name} n={n} {lib}", fn), tokens, fpt, ctx.world, limit
                )
                row[lib] = res
                log(ctx, f"{name} n={n} {lib}: {short(res)}")
            row["limit_ms"] = limit.get("median_ms")
            if "median_ms" in row.get("pipetrain", {}) and "median_ms" in row.get("torch", {}):
                row["pipetrain_over_torch"] = (
                    row["pipetrain"]["median_ms"] / row["torch"]["median_ms"]
                )
            rows.append(row)
            config_s[n] = time.perf_counter() - start
            if ctx.rank == 0 and out:
                write_json(out, meta, limits, rows)
    if ctx.rank == 0:
        if out:
            write_json(out, meta, limits, rows)
            print(plot(out, rows, n_list, names), flush=True)
        print(table(meta, limits, rows), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: h100 on GPU")
    p.add_argument("--out", default=None, help="folder for gpu_pipeline.json/.png (default: none)")
    p.add_argument("--microbatches", default=None, help="comma list, e.g. 16,8")
    p.add_argument(
        "--schedules",
        default="1f1b,interleaved-1f1b,interleaved-zb,zbv,dualpipev",
        help=f"comma list of: {', '.join(FAMILIES)}",
    )
    for name, kind in (
        ("steps", int),
        ("warmup", int),
        ("timeline-steps", int),
        ("limit-steps", int),
        ("vocab", int),
        ("seq", int),
        ("layers", int),
        ("hidden", int),
        ("heads", int),
        ("mb-size", int),
        ("budget-s", float),
    ):
        p.add_argument(f"--{name}", type=kind, default=None, help="overrides the preset")
    p.add_argument("--limit-warmup", type=int, default=2, help="warm-up steps of the limit run")
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 (overrides the preset)")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--op-timeout", type=float, default=60.0, help="pipetrain wait timeout (s)")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout (s)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    p.add_argument(
        "--replay-schedules",
        default="",
        help=f"comma list: also run pipetrain with Pipeline(defer_weight_grads=False) (lib "
        f"{REPLAY}, a diagnostic: I/W split by graph replay, as before deferred weight GEMMs)",
    )
    p.add_argument(
        "--overlap-schedules",
        default="",
        help=f"comma list: also run pipetrain with Pipeline(overlap_pairs=True) (lib {OVERLAP}: "
        "each F&B pair's forward on a side CUDA stream); '' for none",
    )
    args = p.parse_args(argv)
    preset = args.preset or ("h100" if torch.cuda.is_available() else "cpu-smoke")
    for k, v in PRESETS[preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.preset = preset
    return args


if __name__ == "__main__":
    sys.exit(main())
