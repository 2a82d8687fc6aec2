"""pipetrain against the incumbents on the same GPUs (docs/incumbents.md): Megatron-Core's
pipeline schedules, DeepSpeed's pipeline engines and ``torch.distributed.pipelining``; a
benchmark, not a test. One run of this script is one *launch*; ``incumbents_call.py`` runs
several with the libraries' order rotated (``--launch K``) and ``incumbents_stats.py`` pools them.

    torchrun --nproc-per-node 2 benchmarks/incumbents/incumbents.py --out $OUT/l0 --launch 0   # NCCL
    torchrun --nproc-per-node 2 benchmarks/incumbents/incumbents.py --preset cpu-smoke         # gloo
    python benchmarks/incumbents/incumbents.py --report l0/incumbents.json l1/incumbents.json ...

Every library trains the same units (``incumbents_shapes``: each stage a run of deep copies of
one seeded master per unit), the same micro-batch size and count, the same precision (bf16
modules, no library's mixed-precision wrapper, except the ``deepspeed-bf16`` row) and the same
optimizer step (AdamW foreach on the bf16 parameters, ``zero_grad(set_to_none=False)``). A step's
time is the slowest rank's wall time of the whole step including the optimizer (barrier,
synchronize, step, synchronize); every timed step is kept (``all_ms``). Within a configuration
(shape, micro-batches, schedule) the rows' order is rotated by ``launch // 2 + configuration
index`` and reversed in odd launches (``incumbents_plan.launch_order``): every two launches run
every pair of rows both ways round.

Rows: ``pipetrain`` (``Pipeline`` defaults) and its variants (``--variants nodefer``: plain
autograd weight gradients, the incumbents' kernels; ``leadN``/``leadnone``: ``receive_lead``;
``graph``: ``cuda_graph=True``; ``samecut``: the defaults on the incumbents' cut);
``torch`` (``incumbents_runners``); ``megatron``, ``megatron-nosync``, ``megatron-v{V}[-g{G}]
[-wf]`` and ``megatron-gaf`` (``incumbents_megatron``); ``deepspeed``, ``deepspeed-bf16`` and
``deepspeed-dualpipev`` (``incumbents_deepspeed``). Efficiency = limit / step time, the limit
being every rank running its own stages of pipetrain's layout and cut with no pipeline and no
transfers (``--limit-schedules``). Any failure becomes an error row with its first line and the
run goes on; a time budget (``--budget-s``) skips what would not fit.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.gpu_setup import Ctx, clock_stamp, log
from benchmarks.incumbents.incumbents_plan import Plan, launch_order
from benchmarks.incumbents.incumbents_report import PT_FAMILIES, tables
from benchmarks.incumbents.incumbents_runners import measure_limit, pipetrain_options
from benchmarks.incumbents.incumbents_shapes import SHAPES, Row, Shape, UnitBank
from benchmarks.pipeline.gpu_pipeline import guarded

SCHEDULES = (*PT_FAMILIES, "zb-h1")
CPU_SMOKE = dict(
    shapes="gpt-tiny,blocks-tiny,llama-tiny",
    microbatches="",
    steps=2,
    warmup=1,
    dtype="float32",
    budget_s=600.0,
)
PRESETS = {
    "h100": dict(
        shapes="gpt", microbatches="16,8", steps=20, warmup=2, dtype="bfloat16", budget_s=150.0
    ),
    "cpu-smoke": CPU_SMOKE,
    "cpu-wide": CPU_SMOKE | {"shapes": "wide-tiny"},
}
ENV = ("PYTORCH_CUDA_ALLOC_CONF", "NCCL_NVLS_ENABLE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def runner(lib: str):
    """The function that measures ``lib``'s row."""
    if lib.startswith("pipetrain"):
        from benchmarks.incumbents.incumbents_runners import run_pipetrain

        return run_pipetrain
    if lib == "torch":
        from benchmarks.incumbents.incumbents_runners import run_torch

        return run_torch
    if lib.startswith("megatron"):
        from benchmarks.incumbents.incumbents_megatron import run_megatron

        return run_megatron
    if lib.startswith("deepspeed"):
        from benchmarks.incumbents.incumbents_deepspeed import run_deepspeed

        return run_deepspeed
    raise ValueError(f"unknown library {lib!r}")


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


class Run:
    """One launch: the rows in order, the limits, the JSON rewritten after every row."""

    def __init__(self, ctx: Ctx, meta: dict) -> None:
        self.ctx, self.args, self.meta = ctx, ctx.args, meta
        self.bank = UnitBank(ctx.device, ctx.dtype)
        self.plan = Plan(ctx, self.bank)
        self.rows: list[dict] = []
        self.limits: dict[str, dict] = {}
        self.row_s = 0.0
        self.out = Path(self.args.out) if self.args.out else None

    def over_budget(self) -> bool:
        return self.ctx.agree(self.ctx.elapsed() + self.row_s > self.args.budget_s)

    def limit(self, row: Row, graphed: bool = False) -> dict:
        key = f"{row.shape.name}/{row.layout}/{row.v}/{row.n}/{'-'.join(map(str, row.cut))}"
        key += "/graph" if graphed else ""
        if key not in self.limits:
            if self.over_budget():
                self.limits[key] = {"skipped": "time budget"}
            else:
                fn = functools.partial(measure_limit, self.ctx, self.bank, row, graphed)
                self.limits[key] = guarded(self.ctx, f"limit {key}", fn) | {"key": key}
            log(self.ctx, f"limit {key}: {self.limits[key].get('median_ms', self.limits[key])}")
        return self.limits[key]

    def configuration(self, shape: Shape, n: int, schedule: str, index: int) -> None:
        try:
            rows = self.plan.rows(shape, n, schedule)
        except ValueError as e:  # a shape/schedule pair that cannot be cut
            log(self.ctx, f"{shape.name} {schedule} n={n}: no rows ({e})")
            return
        limits: dict[bool, dict] = {}
        if schedule in self.args.limit_schedules.split(","):
            limits[False] = self.limit(rows[0])
            if self.args.limit_graph:  # graphed rows' efficiency against a graphed limit
                limits[True] = self.limit(rows[0], graphed=True)
        for order, row in enumerate(launch_order(rows, self.args.launch, index)):
            self.measure(row, order, limits.get(row.lib.endswith("-graph"), limits.get(False, {})))

    def measure(self, row: Row, order: int, limit: dict) -> None:
        out = {"shape": row.shape.name, "schedule": row.schedule, "microbatches": row.n}
        out |= {"lib": row.lib, "v": row.v, "cut": list(row.cut), "order": order}
        out["tokens_per_step"] = row.tokens
        what = f"{row.shape.name} {row.schedule} n={row.n} {row.lib}"
        if self.over_budget():
            out["skipped"] = f"time budget ({self.args.budget_s:.0f} s) would be exceeded"
            log(self.ctx, f"{what}: skipped (time budget)")
        else:
            start = time.perf_counter()
            out["started"] = clock_stamp()  # to line up with the call's SM clock samples
            fn = runner(row.lib)
            out |= guarded(self.ctx, what, functools.partial(fn, self.ctx, self.bank, row))
            if "median_ms" in out:
                sec = out["median_ms"] / 1e3
                out["tokens_per_s"] = row.tokens / sec
                fpt = row.shape.flops_per_token()
                out["tflops_per_gpu"] = fpt * row.tokens / sec / self.ctx.world / 1e12
                if "median_ms" in limit and row.lib.startswith("pipetrain"):
                    out["efficiency"] = limit["median_ms"] / out["median_ms"]
                    out["limit_ms"] = limit["median_ms"]
                    out["limit_key"] = limit["key"]
            self.row_s = max(self.row_s, time.perf_counter() - start)
            out["ended"] = clock_stamp()
            if "error" not in out:  # guarded has logged the error
                log(self.ctx, f"{what}: {brief(out)}")
        self.rows.append(out)
        self.write()

    def write(self) -> None:
        if self.ctx.rank == 0 and self.out:
            self.meta["cuts"] = self.plan.cuts
            data = {"meta": self.meta, "limits": self.limits, "rows": self.rows}
            (self.out / "incumbents.json").write_text(json.dumps(data, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:
        from benchmarks.incumbents.incumbents_stats import report

        print(report([Path(p) for p in args.report]))
        return 0
    if os.environ.get("STACKS_AFTER"):  # a hang shows where each rank waits (incumbents_call.py)
        faulthandler.dump_traceback_later(float(os.environ["STACKS_AFTER"]))
    ctx = Ctx(args)
    n_list = [int(v) for v in args.microbatches.split(",") if v] or [2 * ctx.world]
    names = [s for s in args.schedules.split(",") if s]
    shapes = [SHAPES[s] for s in args.shapes.split(",") if s]
    if args.out and ctx.rank == 0:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    meta = {
        "versions": versions(),
        "device": torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu",
        "backend": dist.get_backend(),
        "world": ctx.world,
        "launch": args.launch,
        "plan": args.plan,
        "dtype": args.dtype,
        "optimizer": args.optimizer,
        "gc": args.gc,
        "preheat_s": args.preheat_s,
        "steps": args.steps,
        "warmup": args.warmup,
        "env": {k: os.environ.get(k) for k in ENV},
        "shapes": {s.name: asdict(s) for s in shapes},
        "argv": sys.argv,
    }
    log(ctx, f"incumbents launch {args.launch}: {meta['device']} × {ctx.world}, {meta['versions']}")
    run = Run(ctx, meta)
    preheat(ctx, args.preheat_s)
    index = 0
    for shape in shapes:
        for n in n_list:
            for name in names:
                run.configuration(shape, n, name, index)
                index += 1
    run.write()
    if ctx.rank == 0:
        print(tables({"meta": meta, "rows": run.rows}), flush=True)
    # Every row ended in a collective, so all ranks are done. Leave without tearing down: on
    # 4 × H100 (2026-11-26) the teardown after Megatron's and DeepSpeed's extra process groups
    # hung until the launcher's timeout, after the results were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def preheat(ctx: Ctx, seconds: float) -> None:
    """Keep every GPU busy with bf16 matrix products for ``seconds`` before the first row, so
    that no row starts on a card cooler, and clocked higher, than the rows after it get
    (docs/incumbents.md: the first row of a launch measured faster than the same row later)."""
    if seconds <= 0 or not ctx.cuda:
        return
    a = torch.randn(8192, 8192, device=ctx.device, dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(16):
            a @ a
        torch.cuda.synchronize(ctx.device)
    del a
    torch.cuda.empty_cache()
    dist.barrier()
    log(ctx, f"preheated {seconds:.0f} s")


def brief(row: dict) -> str:
    if "median_ms" not in row:
        return row.get("error") or row.get("skipped") or "?"
    mem = row.get("peak_total_gib")
    mem_s = "/".join(f"{m:.2f}" for m in mem) if mem else "-"
    eff = row.get("efficiency")
    return (
        f"{row['median_ms']:.1f} ms [{row['min_ms']:.1f}–{row['max_ms']:.1f}]"
        + (f" eff {eff:.3f}" if eff is not None else "")
        + f" GiB {mem_s}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: h100 on GPU")
    p.add_argument("--report", nargs="+", default=None, help="pool saved launches' JSON files")
    p.add_argument("--out", default=None, help="folder for incumbents.json")
    p.add_argument(
        "--launch",
        type=int,
        default=0,
        help="launch index: rotates (and in odd launches reverses) the row order",
    )
    p.add_argument("--plan", default="", help="a label recorded in the JSON (the call's plan)")
    p.add_argument("--shapes", default=None, help=f"comma list of: {', '.join(SHAPES)}")
    p.add_argument("--microbatches", default=None, help="comma list, e.g. 16,8")
    p.add_argument("--schedules", default=",".join(PT_FAMILIES), help="pipetrain's families")
    p.add_argument(
        "--libraries",
        default="megatron,megatron-nosync,deepspeed",
        help="incumbents besides pipetrain and torch: megatron (1F1B, and interleaved v=2), "
        "megatron-nosync, megatron-sweep (every interleaved variant), megatron-sweep-nowf (all "
        "but the warm-up/flush overlap ones), megatron-tuned (the "
        "--megatron-top fastest of --megatron-tuned-from), megatron-tuned-graph (those as "
        "Megatron's full-iteration CUDA graph), megatron-nosync-graph, megatron-gaf, deepspeed, "
        "deepspeed-bf16, deepspeed-dualpipev",
    )
    p.add_argument("--megatron-tuned-from", default="", help="comma list of earlier JSON files")
    p.add_argument("--megatron-top", type=int, default=2)
    p.add_argument("--torch-schedules", default="1f1b,interleaved-1f1b", help="torch's rows")
    p.add_argument(
        "--variants",
        default="",
        help="pipetrain variants: nodefer,leadnone,lead0,graph,samecut, or joined: nodefer-lead0",
    )
    p.add_argument("--receive-leads", default="", help="old spelling: lead variants (none,0)")
    p.add_argument("--limit-schedules", default=",".join(SCHEDULES), help="limits measured")
    p.add_argument(
        "--limit-graph",
        action="store_true",
        help="also each limit as one CUDA graph per step: the graphed rows' efficiency",
    )
    p.add_argument("--pipetrain-cut", choices=("planner", "incumbent"), default="planner")
    p.add_argument("--costs", default="analytic", help="planner costs: analytic|profile|FILE")
    p.add_argument("--timeline-steps", type=int, default=1, help="timeline=True steps after")
    p.add_argument("--profile", default="", help="comma list of lib:schedule to trace a step of")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--preheat-s", type=float, default=0.0, help="GPU busy before the first row")
    p.add_argument("--dtype", default=None, help="bfloat16 | float32 (overrides the preset)")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw")
    p.add_argument(
        "--gc",
        choices=("python", "manual"),
        default="python",
        help="garbage collector during timed steps: python (automatic) or manual (off, as "
        "Megatron-LM's --manual-gc); each step's pauses are recorded either way",
    )
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--op-timeout", type=float, default=60.0, help="pipetrain wait timeout (s)")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout (s)")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    return completed(p, p.parse_args(argv))


def completed(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """The preset's values where no flag set them, the old lead spelling folded into the
    variants, and every variant, shape and schedule checked now rather than per row."""
    if args.report:
        return args
    preset = args.preset or ("h100" if torch.cuda.is_available() else "cpu-smoke")
    for k, v in PRESETS[preset].items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.preset = preset
    leads = [f"lead{k}" for k in args.receive_leads.split(",") if k]
    args.variants = ",".join([*filter(None, args.variants.split(",")), *leads])
    for v in filter(None, args.variants.split(",")):
        pipetrain_options(f"pipetrain-{v}")  # refuses an unknown variant now, not per row
    bad = [s for s in args.shapes.split(",") if s and s not in SHAPES]
    bad += [s for s in args.schedules.split(",") if s and s not in SCHEDULES]
    if bad:
        p.error(f"unknown {bad}; shapes: {', '.join(SHAPES)}; schedules: {', '.join(SCHEDULES)}")
    # Ctx builds a GPTConfig from these; the shapes build their own
    for k, v in dict(vocab=97, seq=32, layers=8, hidden=64, heads=4, mb_size=2).items():
        setattr(args, k, v)
    return args


if __name__ == "__main__":
    sys.exit(main())
