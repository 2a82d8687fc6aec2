"""``incumbents.py``'s rows for the no-pipeline limit, pipetrain and torch.distributed.pipelining,
and the diagnostics after a row's timed steps (one profiled step, pictures of a step).

Every runner takes the process context, the ``UnitBank`` and a ``Row`` and returns the row's
measurements (``gpu_pipeline.measure``: every timed step's slowest-rank time in ``all_ms``, peak
memory per rank), or ``{"skipped": why}``.
"""

from __future__ import annotations

import inspect
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.gpu_setup import Ctx, make_optimizer, opt_step, slowest, stats, time_steps
from benchmarks.incumbents.incumbents_shapes import FAMS, Row, UnitBank
from benchmarks.pipeline.gpu_pipeline import measure
from benchmarks.pipeline.profile_pipeline_gpu import device_kernels, summarise
from pipetrain.sim.costs import measured_costs
from pipetrain.sim.simulate import simulate

#: pipetrain's variants: the row name's suffix -> ``Pipeline`` options
PIPETRAIN_VARIANTS = {
    # plain autograd weight gradients: the kernels every incumbent runs (equal kernels)
    "nodefer": {"defer_weight_grads": False},
    "leadnone": {"receive_lead": None},
    # the step captured as one CUDA graph and replayed (docs/runtime.md): needs --warmup >= 3
    "graph": {"cuda_graph": True},
    # the defaults on the incumbents' cut instead of the planner's (incumbents_plan): memory and
    # speed at equal layers per rank
    "samecut": {},
}


def pipetrain_options(lib: str) -> dict:
    """``Pipeline`` options of the row ``pipetrain[-variant[-variant...]]`` (``-leadN``:
    ``receive_lead=N``); variants combine where they set different options
    (``pipetrain-nodefer-lead0``)."""
    suffix = lib.removeprefix("pipetrain").removeprefix("-")
    options: dict = {}
    for part in suffix.split("-") if suffix else ():
        if part in PIPETRAIN_VARIANTS:
            more = dict(PIPETRAIN_VARIANTS[part])
        elif part.startswith("lead") and part[4:].isdigit():
            more = {"receive_lead": int(part[4:])}
        else:
            raise ValueError(
                f"unknown pipetrain variant {lib!r}: pipetrain-{{nodefer,leadnone,graph,samecut,"
                "leadN}, joined by '-' where they set different options"
            )
        if options.keys() & more.keys():
            raise ValueError(
                f"pipetrain variant {lib!r} sets {sorted(options.keys() & more.keys())} twice"
            )
        options |= more
    return options


class GradsToNone:
    """A graphed row's optimizer: ``zero_grad`` sets gradients to ``None``, so each replay hands
    its gradient buffers over as ``.grad`` (docs/runtime.md), as the graphed rows of the recorded
    tables ran. Eager rows keep ``set_to_none=False``, which a replay now serves as well (it adds
    into a kept ``.grad`` in place)."""

    def __init__(self, opt) -> None:
        self.opt = opt

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=True)


def measure_limit(ctx: Ctx, bank: UnitBank, row: Row, graphed: bool = False) -> dict:
    """Each rank's own stages of ``row``'s layout and cut, no pipeline, no transfers: per
    micro-batch the forward and backward of each local stage (random activations in, random
    gradients out), then the same optimizer step; the slowest rank's times. ``graphed``: the
    micro-batches' passes captured once as a CUDA graph and replayed, the optimizer step eager,
    as a graphed pipeline row runs — the bound for a row whose host no longer issues kernels
    (an eager limit carries its own host time, so a graphed row can measure above 1 against it)."""
    shape, n = row.shape, row.n
    mine = row.local(ctx.rank, ctx.world)
    last = row.num_stages - 1
    ctx.mem_reset()
    mods = {s: bank.stage(shape, row.cut, s) for s in mine}
    params = [p for m in mods.values() for p in m.parameters()]
    opt = make_optimizer(ctx, params)
    x, y = shape.batch(ctx.device, ctx.dtype, n)
    xs, ys = x.chunk(n), y.chunk(n)
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    size = (shape.mb_size, shape.seq, shape.hidden)
    hid = torch.randn(size, device=ctx.device, dtype=ctx.dtype, generator=gen)
    gout = torch.randn(size, device=ctx.device, dtype=ctx.dtype, generator=gen) * 1e-3

    def passes() -> None:
        for j in range(n):
            for s in mine:
                inp = xs[j] if s == 0 else hid.detach().requires_grad_()
                out = mods[s](inp)
                if s == last:
                    (shape.loss(out, ys[j]) / n).backward()
                else:
                    out.backward(gout)
                del out

    def step() -> None:
        passes()
        opt_step(opt, params)

    for _ in range(ctx.args.warmup):
        step()
    if graphed:
        step = replayed(passes, opt, params)
    return stats(slowest(ctx, time_steps(ctx, step, ctx.args.steps)))


def replayed(passes, opt, params):
    """``passes`` captured as one CUDA graph with the gradients zeroed in place first
    (``recompute_price_gpu.capture``: warmed on a side stream), returned as a step: replay, then
    the eager optimizer step, which reads the gradients the replay accumulated."""
    from benchmarks.recompute.recompute_price_gpu import capture  # CUDA only

    if opt is None:
        raise ValueError("a graphed limit needs an optimizer that zeroes gradients in place")

    def zeroed() -> None:
        opt.zero_grad(set_to_none=False)
        passes()

    graph = capture(zeroed)

    def step() -> None:
        graph.replay()
        opt_step(opt, params)

    return step


def run_pipetrain(ctx: Ctx, bank: UnitBank, row: Row) -> dict:
    """``Pipeline`` with its defaults, or a variant's options (``pipetrain_options``)."""
    from pipetrain.runtime.pipeline import Pipeline

    base = ctx.mem_reset()
    pipe = Pipeline(
        lambda s: bank.stage(row.shape, row.cut, s),
        row.schedule,
        row.n,
        row.shape.loss,
        stages_per_rank=row.v,
        num_stages=row.num_stages,
        device=ctx.device,
        timeout=timedelta(seconds=ctx.args.op_timeout),
        **pipetrain_options(row.lib),
    )
    expect = row.local(ctx.rank, ctx.world)
    if sorted(pipe.placement.stages_of_rank(ctx.rank)) != sorted(expect):
        raise RuntimeError(f"pipetrain's placement differs from the incumbents' {expect}")
    params = list(pipe.parameters())
    opt = make_optimizer(ctx, params)
    if pipe.graph is not None and opt is not None:
        if ctx.args.warmup < 3 or ctx.args.timeline_steps:
            raise ValueError("a graphed row needs --warmup >= 3 and --timeline-steps 0")
        opt = GradsToNone(opt)
    x, y = row.shape.batch(ctx.device, ctx.dtype, row.n)
    out, _ = measure(ctx, lambda: pipe.step(x, y), opt, params, base)
    timelines = []
    for _ in range(ctx.args.timeline_steps):  # after the timed steps: recording costs time
        pipe.step(x, y, timeline=True)
        timelines.append(pipe.last_timeline)
        opt_step(opt, params)
    if timelines:
        out["bubble_measured"] = statistics.fmean(t.bubble_fraction for t in timelines)
        out["makespan_measured_ms"] = statistics.fmean(t.makespan for t in timelines)
        # per rank, idle before actions its host had not begun issuing: does the host fall behind?
        idle = timelines[-1].host_bound_idle
        if idle is not None:
            out["host_bound_idle_ms"] = [round(x, 3) for x in idle]
        # the same program simulated with the per-stage times this run measured (transfers free)
        simulated = simulate(pipe.program, measured_costs(timelines, row.num_stages))
        out["bubble_simulated"] = simulated.bubble_fraction
        out["makespan_simulated_ms"] = simulated.makespan
        if ctx.rank == 0 and ctx.args.out:
            stem = f"{row.shape.name}-{row.schedule}-{row.n}-{row.lib}"
            draw_step(Path(ctx.args.out), stem, timelines[-1], simulated)
    out.update(profiled(ctx, row, lambda: pipe.step(x, y), opt, params))
    return out


def draw_step(out: Path, stem: str, measured, simulated) -> None:
    """``steps/<stem>-measured.svg`` and ``-simulated.svg``: the step as it ran and as the simulator
    predicts it from the same step's measured per-stage times, on the same time scale."""
    from pipetrain.render.svg import render_svg

    folder = out / "steps"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}-measured.svg").write_text(render_svg(measured, title=f"{stem}, measured"))
    (folder / f"{stem}-simulated.svg").write_text(
        render_svg(simulated, title=f"{stem}, simulated from its measured stage times")
    )


def profiled(ctx: Ctx, row: Row, step, opt, params) -> dict:
    """With ``--profile lib:schedule``: one more step (optimizer included) under torch.profiler.
    Every rank's device-time summary goes into the row (``profile``: per rank, as
    ``profile_pipeline_gpu.summarise`` counts it); the first and the last rank also write their
    trace as ``trace-….json.gz`` beside the JSON."""
    if f"{row.lib}:{row.schedule}" not in ctx.args.profile.split(","):
        return {}
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    ctx.barrier()
    ctx.sync()
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        step()
        opt_step(opt, params)
        ctx.sync()
        wall_ms = 1e3 * (time.perf_counter() - t)
    mine = {"rank": ctx.rank, "step_wall_ms": wall_ms, **summarise(device_kernels(prof), 1)}
    out: dict = {"profile": ctx.gather(mine)}
    if ctx.args.out and ctx.rank in (0, ctx.world - 1):
        name = f"trace-{row.shape.name}-{row.schedule}-{row.n}-{row.lib}-r{ctx.rank}.json.gz"
        prof.export_chrome_trace(str(Path(ctx.args.out) / name))
        out["trace"] = name
    ctx.barrier()  # the next row starts together, after the slow trace export
    return out


def run_torch(ctx: Ctx, bank: UnitBank, row: Row) -> dict:
    """torch.distributed.pipelining: ``PipelineStage`` per local stage and the family's schedule
    class (ZB-H1: ``ScheduleInterleavedZeroBubble`` over one stage per rank)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    name = FAMS[row.schedule].torch_class
    cls = getattr(S, name, None)
    if cls is None:
        return {"skipped": f"not in this torch ({torch.__version__}): {name}"}
    mine = row.local(ctx.rank, ctx.world)
    base = ctx.mem_reset()
    mods = {s: bank.stage(row.shape, row.cut, s) for s in mine}
    stages = [PipelineStage(mods[s], s, row.num_stages, ctx.device) for s in mine]
    single = issubclass(cls, S.PipelineScheduleSingle)
    sched = cls(stages[0] if single else stages, row.n, loss_fn=row.shape.loss)
    params = [p for m in mods.values() for p in m.parameters()]
    opt = make_optimizer(ctx, params)
    x, y = row.shape.batch(ctx.device, ctx.dtype, row.n)
    args = (x,) if 0 in mine else ()
    kwargs: dict = {"target": y} if row.num_stages - 1 in mine else {}
    if "return_outputs" in inspect.signature(sched.step).parameters:
        kwargs["return_outputs"] = False
    out, _ = measure(ctx, lambda: sched.step(*args, **kwargs), opt, params, base)
    out.update(profiled(ctx, row, lambda: sched.step(*args, **kwargs), opt, params))
    return out
