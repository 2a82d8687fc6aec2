"""pipetrain against the incumbents on the same GPUs (docs/incumbents.md): Megatron-Core's
pipeline schedules, DeepSpeed's ``PipelineEngine`` and ``torch.distributed.pipelining``; a
benchmark, not a test.

    torchrun --nproc-per-node 4 benchmarks/gpu/incumbents.py --out $OUT/p4        # GPUs, NCCL
    torchrun --nproc-per-node 2 benchmarks/gpu/incumbents.py --preset cpu-smoke   # CPU, gloo
    python benchmarks/gpu/incumbents.py --report p4/incumbents.json p2/incumbents.json

Every library trains the same model: each stage is a deep copy of one seeded master per stage
(``pipetrain.app.models.gpt``), the same micro-batch size and count, the same precision (the
modules themselves are bf16; no library's mixed-precision wrapper) and the same optimizer step
(AdamW foreach on the bf16 parameters, ``zero_grad(set_to_none=False)``; DeepSpeed gets the same
``torch.optim.AdamW`` as its client optimizer and steps it inside ``train_batch``). A step's time
is the slowest rank's wall time of the whole step including the optimizer (barrier, synchronize,
step, synchronize), the median over timed steps after warm-up; the libraries' order rotates
between configurations.

How each incumbent is set up (their recommended settings, nothing of theirs patched):

* Megatron-Core: ``parallel_state.initialize_model_parallel(pipeline_model_parallel_size=P,
  virtual_pipeline_model_parallel_size=2 | None)`` and ``get_forward_backward_func()``, with a
  ``ModelParallelConfig`` that has ``hidden_size`` set on it, and plain torch modules carrying
  ``config``, ``model_type`` and ``set_input_tensor``, as Megatron's own schedule tests build
  them. Interleaved 1F1B: ``overlap_p2p_comm=True, batch_p2p_comm=False`` (Megatron-LM's
  default with virtual stages); 1F1B: ``batch_p2p_comm=True`` with the default
  ``batch_p2p_sync=True`` (a device synchronize after each batched transfer), and a
  ``megatron-nosync`` row with ``batch_p2p_sync=False``. ``deallocate_pipeline_outputs=True``
  (Megatron-LM's setting). Megatron's transfers are sequence-first ``[s, b, h]``; the model is
  batch-first, so a chunk reinterprets the received buffer as ``[b, s, h]`` (a view, no copy)
  and hands back its output reinterpreted as ``[s, b, h]`` through one ``clone`` (Megatron
  frees sent outputs and refuses to free a view), a small cost per micro-batch (docs/incumbents.md).
* DeepSpeed: ``PipelineModule`` of one ``LayerSpec`` per stage (``partition_method='uniform'``,
  so stage s is exactly the same module as everyone's stage s), ``deepspeed.initialize`` with
  the client AdamW, ``train_micro_batch_size_per_gpu`` = micro-batch size,
  ``gradient_accumulation_steps`` = micro-batch count, and ``engine.train_batch`` (its 1F1B
  ``TrainSchedule``, optimizer step included). Its ``bf16`` option is off on purpose: it would
  swap in its BF16_Optimizer (fp32 master weights and fp32 gradient accumulation), a different
  optimizer from everyone else's.
* torch: ``PipelineStage`` + ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (…), as
  ``gpu_pipeline.py`` runs them.
* pipetrain: ``Pipeline`` with its defaults, as ``gpu_pipeline.py``'s ``pipetrain`` rows; with
  ``--receive-leads none,0`` also rows ``pipetrain-leadnone``/``-lead0``:
  ``Pipeline(receive_lead=N)`` (each receive posted at most N compute actions before its reader;
  none: where lowering puts them, as soon as the value can have arrived).

Efficiency = limit / step time, the limit being every rank running its own stages of the
schedule's layout with no pipeline and no transfers (forward and backward of each local stage per
micro-batch, random activations in and gradients out, then the same optimizer step); the slowest
rank's median. Peak memory per rank: ``max_memory_allocated`` over the timed steps (optimizer
step included) above what was allocated before the library's modules were built.

Diagnostics after the timed steps, never inside them: ``--timeline-steps`` pipetrain steps
recorded with ``timeline=True`` (the measured bubble fraction), and ``--profile lib:schedule,…``
one step of each named row under torch.profiler (``trace-<shape>-<schedule>-<n>-<lib>-r<rank>
.json.gz`` from the first and the last rank).

Any failure becomes an error row with the error's first line and the run goes on; a time budget
skips what would not fit.
"""

from __future__ import annotations

import argparse
import copy
import functools
import inspect
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpu_pipeline import guarded, measure  # beside this script
from gpu_setup import (
    FAMILIES,
    Ctx,
    local_stages,
    log,
    make_optimizer,
    opt_step,
    slowest,
    stats,
    time_steps,
)
from incumbents_report import (  # beside this script
    DEEPSPEED,
    MEGATRON,
    MEGATRON_NOSYNC,
    PIPETRAIN,
    PT_FAMILIES,
    TORCH,
    report,
    tables,
)
from profile_pipeline_gpu import device_kernels, summarise  # beside this script
from torch import nn

from pipetrain.app.models.gpt import GPTConfig, GPTStage, lm_loss, make_stage, stage_layers
from pipetrain.sim.costs import measured_costs
from pipetrain.sim.simulate import simulate

#: which libraries run which schedule family
LIBRARY_FAMILIES = {
    MEGATRON: ("1f1b", "interleaved-1f1b"),
    MEGATRON_NOSYNC: ("1f1b",),
    DEEPSPEED: ("1f1b",),
}


# ---------------------------------------------------------------------------------------------
# model shapes
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One model: ``gpt`` (embedding + blocks + head, cross-entropy) or ``blocks`` (pre-norm
    blocks on hidden states, MSE against random targets)."""

    name: str
    kind: str
    layers: int
    hidden: int
    heads: int
    seq: int
    mb_size: int
    vocab: int = 8192

    def config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab,
            seq_len=self.seq,
            num_layers=self.layers,
            hidden=self.hidden,
            num_heads=self.heads,
        )

    def build(self, num_stages: int, s: int) -> nn.Module:
        cfg = self.config()
        if self.kind == "gpt":
            return make_stage(cfg, s, num_stages, seed=0)
        first, last = stage_layers(cfg.num_layers, num_stages)[s]
        return GPTStage(cfg, first, last, embed=False, head=False, seed=0)

    @property
    def loss(self):
        return lm_loss if self.kind == "gpt" else mse_loss

    def batch(self, ctx: Ctx, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1234 + n)
        b = n * self.mb_size
        if self.kind == "gpt":
            x = torch.randint(0, self.vocab, (b, self.seq), generator=g)
            y = torch.randint(0, self.vocab, (b, self.seq), generator=g)
        else:
            x = torch.randn(b, self.seq, self.hidden, generator=g).to(ctx.dtype)
            y = torch.randn(b, self.seq, self.hidden, generator=g).to(ctx.dtype)
        return x.to(ctx.device), y.to(ctx.device)

    def flops_per_token(self) -> float:
        """6·P + 12·L·s·h, P = parameters except embeddings (the Megatron/PaLM convention)."""
        h, L = self.hidden, self.layers
        block = 4 * h * h + 4 * h + 2 * 4 * h * h + 5 * h + 4 * h
        params = L * block + (2 * h + h * self.vocab if self.kind == "gpt" else 0)
        return 6 * params + 12 * L * self.seq * h


def mse_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), target.float())


SHAPES = {
    # docs/benchmarks.md's GPT: 16 layers × hidden 2048, seq 1024, vocabulary 8192, micro-batch 4
    "gpt": Shape("gpt", "gpt", layers=16, hidden=2048, heads=16, seq=1024, mb_size=4),
    # docs/incumbents.md's block stack: 16 pre-norm blocks, hidden 2048, 16 heads, seq 1024, MSE
    "blocks": Shape("blocks", "blocks", layers=16, hidden=2048, heads=16, seq=1024, mb_size=4),
    # wide and long: transfers of 32 MiB per micro-batch
    "wide": Shape("wide", "gpt", layers=8, hidden=4096, heads=32, seq=4096, mb_size=1),
    # CPU smoke shapes
    "gpt-tiny": Shape("gpt-tiny", "gpt", layers=8, hidden=64, heads=4, seq=32, mb_size=2, vocab=97),
    "blocks-tiny": Shape("blocks-tiny", "blocks", layers=8, hidden=64, heads=4, seq=32, mb_size=2),
    # the wide shape's code path (one sample per micro-batch, sequence longer than hidden)
    "wide-tiny": Shape(
        "wide-tiny", "gpt", layers=8, hidden=64, heads=8, seq=128, mb_size=1, vocab=97
    ),
}

#: the plumbing on gloo: tiny shapes, 2 × ranks micro-batches, float32
CPU_SMOKE = dict(
    shapes="gpt-tiny,blocks-tiny",
    microbatches="",
    steps=2,
    warmup=1,
    dtype="float32",
    budget_s=300.0,
)
PRESETS = {
    "h100": dict(
        shapes="gpt", microbatches="16,8", steps=6, warmup=2, dtype="bfloat16", budget_s=150.0
    ),
    "cpu-smoke": CPU_SMOKE,
    "cpu-wide": CPU_SMOKE | {"shapes": "wide-tiny"},
}


class Masters:
    """One seeded master per (shape, stage count, stage), built once on the CPU in the run's
    dtype; every library gets deep copies of the same masters (equal weights, nothing shared)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self._masters: dict[tuple[str, int, int], nn.Module] = {}

    def stage(self, shape: Shape, num_stages: int, s: int) -> nn.Module:
        key = (shape.name, num_stages, s)
        if key not in self._masters:
            self._masters[key] = shape.build(num_stages, s).to(self.ctx.dtype)
        return copy.deepcopy(self._masters[key]).to(self.ctx.device)


# ---------------------------------------------------------------------------------------------
# the limit, pipetrain and torch
# ---------------------------------------------------------------------------------------------


def measure_limit(ctx: Ctx, masters: Masters, shape: Shape, layout: str, v: int, n: int) -> dict:
    """Each rank's own stages of ``layout``, no pipeline, no transfers (see the module doc)."""
    num_stages = v * ctx.world
    mine = local_stages(layout, ctx.rank, ctx.world, v)
    ctx.mem_reset()
    mods = {s: masters.stage(shape, num_stages, s) for s in mine}
    params = [p for m in mods.values() for p in m.parameters()]
    opt = make_optimizer(ctx, params)
    x, y = shape.batch(ctx, n)
    xs, ys = x.chunk(n), y.chunk(n)
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    size = (shape.mb_size, shape.seq, shape.hidden)
    hid = torch.randn(size, device=ctx.device, dtype=ctx.dtype, generator=gen)
    gout = torch.randn(size, device=ctx.device, dtype=ctx.dtype, generator=gen) * 1e-3

    def step() -> None:
        for j in range(n):
            for s in mine:
                inp = xs[j] if s == 0 else hid.detach().requires_grad_()
                out = mods[s](inp)
                if s == num_stages - 1:
                    (shape.loss(out, ys[j]) / n).backward()
                else:
                    out.backward(gout)
                del out
        opt_step(opt, params)

    for _ in range(ctx.args.warmup):
        step()
    return stats(slowest(ctx, time_steps(ctx, step, ctx.args.steps)))


def run_pipetrain(
    ctx: Ctx,
    masters: Masters,
    shape: Shape,
    name: str,
    n: int,
    lib: str = PIPETRAIN,
    options: dict | None = None,
) -> dict:
    """pipetrain's row ``lib``: ``Pipeline`` with its defaults, or with ``options`` (the
    ``pipetrain-leadN`` rows: ``receive_lead=N``, ``None`` for ``leadnone``)."""
    from pipetrain.runtime.pipeline import Pipeline

    fam = FAMILIES[name]
    num_stages = fam.stages_per_rank * ctx.world
    base = ctx.mem_reset()
    pipe = Pipeline(
        lambda s: masters.stage(shape, num_stages, s),
        name,
        n,
        shape.loss,
        stages_per_rank=fam.stages_per_rank,
        num_stages=num_stages,
        device=ctx.device,
        timeout=timedelta(seconds=ctx.args.op_timeout),
        **(options or {}),
    )
    expect = local_stages(fam.layout, ctx.rank, ctx.world, fam.stages_per_rank)
    if sorted(pipe.placement.stages_of_rank(ctx.rank)) != sorted(expect):
        raise RuntimeError(f"pipetrain's placement differs from the incumbents' {expect}")
    params = list(pipe.parameters())
    opt = make_optimizer(ctx, params)
    x, y = shape.batch(ctx, n)
    row, _ = measure(ctx, lambda: pipe.step(x, y), opt, params, base)
    timelines = []
    for _ in range(ctx.args.timeline_steps):  # after the timed steps: recording costs time
        pipe.step(x, y, timeline=True)
        timelines.append(pipe.last_timeline)
        opt_step(opt, params)
    if timelines:
        row["bubble_measured"] = statistics.fmean(t.bubble_fraction for t in timelines)
        row["makespan_measured_ms"] = statistics.fmean(t.makespan for t in timelines)
        # the same program simulated with the per-stage times this run measured (transfers free)
        simulated = simulate(pipe.program, measured_costs(timelines, num_stages))
        row["bubble_simulated"] = simulated.bubble_fraction
        row["makespan_simulated_ms"] = simulated.makespan
        if ctx.rank == 0 and ctx.args.out:
            draw_step(
                Path(ctx.args.out), f"{shape.name}-{name}-{n}-{lib}", timelines[-1], simulated
            )
    row.update(profiled(ctx, lib, shape, name, n, lambda: pipe.step(x, y), opt, params))
    return row


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


def profiled(ctx: Ctx, lib: str, shape: Shape, name: str, n: int, step, opt, params) -> dict:
    """With ``--profile lib:schedule``: one more step (optimizer included) under torch.profiler.
    Every rank's device-time summary goes into the row (``profile``: per rank, as
    ``profile_pipeline_gpu.summarise`` counts it: kernel time by kind, idle time in the window,
    compute under resident NCCL kernels, the top kernels); the first and the last rank also
    write their trace as ``trace-….json.gz`` beside the JSON."""
    if f"{lib}:{name}" not in ctx.args.profile.split(","):
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
    row: dict = {"profile": ctx.gather(mine)}
    if ctx.args.out and ctx.rank in (0, ctx.world - 1):
        path = Path(ctx.args.out) / f"trace-{shape.name}-{name}-{n}-{lib}-r{ctx.rank}.json.gz"
        prof.export_chrome_trace(str(path))
        row["trace"] = path.name
    ctx.barrier()  # the next row starts together, after the slow trace export
    return row


def run_torch(ctx: Ctx, masters: Masters, shape: Shape, name: str, n: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining import schedules as S

    fam = FAMILIES[name]
    cls = getattr(S, fam.torch_class, None)
    if cls is None:
        return {"skipped": f"not in this torch ({torch.__version__}): {fam.torch_class}"}
    num_stages = fam.stages_per_rank * ctx.world
    mine = local_stages(fam.layout, ctx.rank, ctx.world, fam.stages_per_rank)
    base = ctx.mem_reset()
    mods = {s: masters.stage(shape, num_stages, s) for s in mine}
    stages = [PipelineStage(mods[s], s, num_stages, ctx.device) for s in mine]
    sched = cls(stages if fam.stages_per_rank > 1 else stages[0], n, loss_fn=shape.loss)
    params = [p for m in mods.values() for p in m.parameters()]
    opt = make_optimizer(ctx, params)
    x, y = shape.batch(ctx, n)
    args = (x,) if 0 in mine else ()
    kwargs: dict = {"target": y} if num_stages - 1 in mine else {}
    if "return_outputs" in inspect.signature(sched.step).parameters:
        kwargs["return_outputs"] = False
    row, _ = measure(ctx, lambda: sched.step(*args, **kwargs), opt, params, base)
    row.update(
        profiled(ctx, TORCH, shape, name, n, lambda: sched.step(*args, **kwargs), opt, params)
    )
    return row


# ---------------------------------------------------------------------------------------------
# Megatron-Core
# ---------------------------------------------------------------------------------------------


class MegatronChunk(nn.Module):
    """One of our stages as a Megatron model chunk: ``config``, ``model_type``, ``vp_stage`` and
    ``set_input_tensor`` (the received activation, which the chunk uses instead of the data
    unless it holds stage 0), as in Megatron's own pipeline-schedule tests."""

    def __init__(self, stage: nn.Module, config, model_type, vp_stage, first: bool, last: bool):
        super().__init__()
        self.stage = stage
        self.config = config
        self.model_type = model_type
        self.vp_stage = vp_stage
        self.first, self.last = first, last
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.first:
            s, b, h = self.input_tensor.shape
            x = self.input_tensor.view(b, s, h)  # the sender's [b, s, h] bytes, reinterpreted
        out = self.stage(x)
        if self.last:
            return out
        b, s, h = out.shape
        return out.view(s, b, h).clone()  # Megatron frees sent outputs and refuses views


def run_megatron(
    ctx: Ctx, masters: Masters, shape: Shape, name: str, n: int, sync: bool = True
) -> dict:
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func

    fam = FAMILIES[name]
    interleaved = fam.stages_per_rank > 1
    vp = fam.stages_per_rank if interleaved else None
    num_stages = fam.stages_per_rank * ctx.world
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=ctx.world,
        virtual_pipeline_model_parallel_size=vp,
        create_gloo_process_groups=False,
    )
    try:
        config = ModelParallelConfig(
            pipeline_model_parallel_size=ctx.world,
            virtual_pipeline_model_parallel_size=vp,
            pipeline_dtype=ctx.dtype,
            params_dtype=ctx.dtype,
            overlap_p2p_comm=interleaved,
            batch_p2p_comm=not interleaved,
            batch_p2p_sync=sync,
            deallocate_pipeline_outputs=True,
        )
        config.hidden_size = shape.hidden  # as Megatron's schedule tests set it
        mine = local_stages(fam.layout, ctx.rank, ctx.world, fam.stages_per_rank)
        base = ctx.mem_reset()
        chunks = [
            MegatronChunk(
                masters.stage(shape, num_stages, s),
                config,
                ModelType.encoder_or_decoder,
                c if interleaved else None,
                s == 0,
                s == num_stages - 1,
            )
            for c, s in enumerate(mine)
        ]
        params = [p for m in chunks for p in m.parameters()]
        opt = make_optimizer(ctx, params)
        x, y = shape.batch(ctx, n)
        pairs = list(zip(x.chunk(n), y.chunk(n)))
        loss_fn = shape.loss

        def loss_func(target, output):
            loss = loss_fn(output, target)
            return loss, {"loss": loss.detach()}

        def forward_step(data_iterator, model):
            xb, yb = next(data_iterator)
            return model(xb), functools.partial(loss_func, yb)

        fb = get_forward_backward_func()

        def step() -> None:
            iters = [iter(pairs) for _ in chunks]
            fb(
                forward_step_func=forward_step,
                data_iterator=iters if interleaved else iters[0],
                model=chunks if interleaved else chunks[0],
                num_microbatches=n,
                seq_length=shape.seq,
                micro_batch_size=shape.mb_size,
                forward_only=False,
            )

        row, _ = measure(ctx, step, opt, params, base)
        row["function"] = fb.__name__
        lib = MEGATRON if sync else MEGATRON_NOSYNC
        row.update(profiled(ctx, lib, shape, name, n, step, opt, params))
        return row
    finally:
        parallel_state.destroy_model_parallel()


# ---------------------------------------------------------------------------------------------
# DeepSpeed
# ---------------------------------------------------------------------------------------------


class DeepSpeedStage(nn.Module):
    """A ``LayerSpec`` target: stage ``s`` of ``num_stages``, a deep copy of the shared master."""

    def __init__(self, build, s: int) -> None:
        super().__init__()
        self.inner = build(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


def run_deepspeed(ctx: Ctx, masters: Masters, shape: Shape, name: str, n: int) -> dict:
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    num_stages = ctx.world
    base = ctx.mem_reset()
    build = functools.partial(masters.stage, shape, num_stages)
    module = PipelineModule(
        layers=[LayerSpec(DeepSpeedStage, build, s) for s in range(num_stages)],
        num_stages=num_stages,
        loss_fn=shape.loss,
        partition_method="uniform",
        activation_checkpoint_interval=0,
    )
    params = [p for p in module.parameters() if p.requires_grad]
    opt = make_optimizer(ctx, params)
    config = {
        "train_batch_size": shape.mb_size * n,
        "train_micro_batch_size_per_gpu": shape.mb_size,
        "gradient_accumulation_steps": n,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 0},
    }
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=config)
    x, y = shape.batch(ctx, n)
    pairs = list(zip(x.chunk(n), y.chunk(n)))
    # train_batch steps the optimizer itself: nothing more to step after it (opt None)

    def step() -> None:
        engine.train_batch(data_iter=iter(pairs))

    row, _ = measure(ctx, step, None, [], base)
    row.update(profiled(ctx, DEEPSPEED, shape, name, n, step, None, []))
    row["stage_layers"] = ctx.gather(list(module.parts))[0]
    return row


RUNNERS = {
    PIPETRAIN: run_pipetrain,
    TORCH: run_torch,
    MEGATRON: run_megatron,
    MEGATRON_NOSYNC: functools.partial(run_megatron, sync=False),
    DEEPSPEED: run_deepspeed,
}


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def versions() -> dict:
    from importlib import metadata

    out = {"torch": torch.__version__}
    for dist_name in ("megatron-core", "deepspeed", "pipetrain"):
        try:
            out[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            out[dist_name] = None
    if torch.cuda.is_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return out


def runner(lib: str):
    """The function that measures ``lib``'s row (``pipetrain-leadN``: pipetrain, receives late)."""
    if lib.startswith(f"{PIPETRAIN}-lead"):
        lead = lib.removeprefix(f"{PIPETRAIN}-lead")
        options = {"receive_lead": None if lead == "none" else int(lead)}
        return functools.partial(run_pipetrain, lib=lib, options=options)
    return RUNNERS[lib]


def libraries_for(args: argparse.Namespace, name: str) -> list[str]:
    libs = [PIPETRAIN] + [f"{PIPETRAIN}-lead{k}" for k in args.receive_leads.split(",") if k]
    if name in args.torch_schedules.split(","):
        libs.append(TORCH)
    for lib, families in LIBRARY_FAMILIES.items():
        if lib in args.libraries.split(",") and name in families:
            libs.append(lib)
    return libs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        print(report([Path(p) for p in args.report]))
        return 0
    ctx = Ctx(args)
    masters = Masters(ctx)
    n_list = [int(v) for v in args.microbatches.split(",") if v] or [2 * ctx.world]
    names = [s for s in args.schedules.split(",") if s]
    shapes = [SHAPES[s] for s in args.shapes.split(",") if s]
    out = Path(args.out) if args.out else None
    if out and ctx.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    meta = {
        "versions": versions(),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu",
        "backend": dist.get_backend(),
        "world": ctx.world,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "steps": args.steps,
        "warmup": args.warmup,
        "shapes": {s.name: asdict(s) for s in shapes},
        "argv": sys.argv,
    }
    log(ctx, f"incumbents: {meta['device']} × {ctx.world}, {meta['versions']}")
    rows: list[dict] = []
    limits: dict[str, dict] = {}
    index = 0
    row_s = 0.0
    for shape in shapes:
        fpt = shape.flops_per_token()
        for n in n_list:
            tokens = n * shape.mb_size * shape.seq
            for name in names:
                fam = FAMILIES[name]
                key = f"{shape.name}/{fam.layout}/{fam.stages_per_rank}/{n}"
                if key not in limits:
                    if ctx.agree(ctx.elapsed() + row_s > args.budget_s):
                        limits[key] = {"skipped": "time budget"}
                    else:
                        limits[key] = guarded(
                            ctx,
                            f"limit {key}",
                            lambda f=fam, n=n, sh=shape: measure_limit(
                                ctx, masters, sh, f.layout, f.stages_per_rank, n
                            ),
                        )
                    log(ctx, f"limit {key}: {limits[key].get('median_ms', limits[key])}")
                limit = limits[key]
                libs = libraries_for(args, name)
                libs = libs[index % len(libs) :] + libs[: index % len(libs)]
                index += 1
                for lib in libs:
                    row = {"shape": shape.name, "schedule": name, "microbatches": n, "lib": lib}
                    row["tokens_per_step"] = tokens
                    if ctx.agree(ctx.elapsed() + row_s > args.budget_s):
                        row["skipped"] = f"time budget ({args.budget_s:.0f} s) would be exceeded"
                        rows.append(row)
                        log(ctx, f"{shape.name} {name} n={n} {lib}: skipped (time budget)")
                        continue
                    start = time.perf_counter()
                    fn = functools.partial(runner(lib), ctx, masters, shape, name, n)
                    res = guarded(ctx, f"{shape.name} {name} n={n} {lib}", fn)
                    row.update(res)
                    if "median_ms" in res:
                        sec = res["median_ms"] / 1e3
                        row["tokens_per_s"] = tokens / sec
                        row["tflops_per_gpu"] = fpt * tokens / sec / ctx.world / 1e12
                        if "median_ms" in limit:
                            row["efficiency"] = limit["median_ms"] / res["median_ms"]
                        row["limit_ms"] = limit.get("median_ms")
                    rows.append(row)
                    row_s = max(row_s, time.perf_counter() - start)
                    log(ctx, f"{shape.name} {name} n={n} {lib}: {brief(row)}")
                    if ctx.rank == 0 and out:
                        write_json(out, meta, limits, rows)
    if ctx.rank == 0:
        if out:
            write_json(out, meta, limits, rows)
        print(tables({"meta": meta, "rows": rows}), flush=True)
    # Every row ended in a collective, so all ranks are done. Leave without tearing down: on
    # 4 × H100 (2026-11-26) the teardown after Megatron's and DeepSpeed's extra process groups
    # hung until the launcher's timeout, after the results were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def brief(row: dict) -> str:
    if "median_ms" not in row:
        return row.get("error") or row.get("skipped") or "?"
    mem, reserved = row.get("peak_total_gib"), row.get("peak_reserved_gib")
    mem_s = "/".join(f"{m:.2f}" for m in mem) if mem else "-"
    reserved_s = "/".join(f"{m:.2f}" for m in reserved) if reserved else "-"
    eff = row.get("efficiency")
    return (
        f"{row['median_ms']:.1f} ms [{row['min_ms']:.1f}–{row['max_ms']:.1f}]"
        f" eff {eff:.3f}" * (eff is not None) + f" GiB {mem_s} reserved {reserved_s}"
    )


def write_json(out: Path, meta: dict, limits: dict, rows: list[dict]) -> None:
    data = {"meta": meta, "limits": limits, "rows": rows}
    (out / "incumbents.json").write_text(json.dumps(data, indent=1, default=str))


# ---------------------------------------------------------------------------------------------
# tables and the targets
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: h100 on GPU")
    p.add_argument("--report", nargs="+", default=None, help="print tables of saved JSON files")
    p.add_argument("--out", default=None, help="folder for incumbents.json")
    p.add_argument("--shapes", default=None, help=f"comma list of: {', '.join(SHAPES)}")
    p.add_argument("--microbatches", default=None, help="comma list, e.g. 16,8")
    p.add_argument("--schedules", default=",".join(PT_FAMILIES), help="pipetrain's families")
    p.add_argument(
        "--libraries",
        default=f"{MEGATRON},{MEGATRON_NOSYNC},{DEEPSPEED}",
        help="incumbents to run besides pipetrain and torch",
    )
    p.add_argument(
        "--torch-schedules", default="1f1b,interleaved-1f1b", help="families torch also runs"
    )
    p.add_argument(
        "--receive-leads",
        default="",
        help="comma list of Pipeline(receive_lead=N) variants to run beside pipetrain's default, "
        "N a number or none (rows pipetrain-leadN)",
    )
    p.add_argument(
        "--timeline-steps",
        type=int,
        default=1,
        help="pipetrain steps recorded with timeline=True after the timed ones (measured bubble)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="comma list of lib:schedule (e.g. megatron:interleaved-1f1b) to trace one step of",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 (overrides the preset)")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--op-timeout", type=float, default=60.0, help="pipetrain wait timeout (s)")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout (s)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)
    if args.report:
        return args
    preset = args.preset or ("h100" if torch.cuda.is_available() else "cpu-smoke")
    for k, v in PRESETS[preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.preset = preset
    bad = [s for s in args.shapes.split(",") if s and s not in SHAPES]
    bad += [s for s in args.schedules.split(",") if s and s not in PT_FAMILIES]
    if bad:
        p.error(f"unknown {bad}; shapes: {', '.join(SHAPES)}; schedules: {', '.join(PT_FAMILIES)}")
    # Ctx builds a GPTConfig from these; the shapes build their own
    for k, v in dict(vocab=97, seq=32, layers=8, hidden=64, heads=4, mb_size=2).items():
        setattr(args, k, v)
    return args


if __name__ == "__main__":
    sys.exit(main())
