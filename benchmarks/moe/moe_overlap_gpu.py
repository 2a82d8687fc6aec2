"""Does DualPipeV's F&B overlap hide a mixture-of-experts model's expert all-to-all on several
GPUs? pipetrain's DualPipeV with ``overlap_pairs=True`` against the same schedule without it,
ZBV and 1F1B, on one Qwen3-MoE-shaped model under pp × ep; a benchmark.

    torchrun --nproc-per-node 4 benchmarks/moe/moe_overlap_gpu.py --preset h200x4 --out $OUT
    torchrun --nproc-per-node 4 benchmarks/moe/moe_overlap_gpu.py --preset h200x4 --out $OUT --profile
    torchrun --nproc-per-node 8 benchmarks/moe/moe_overlap_gpu.py --preset h200x8 --out $OUT
    python benchmarks/moe/moe_overlap_gpu.py --preset cpu-smoke --out /tmp/moe   # gloo, 4 processes

The model (``moe_overlap_model``): Qwen3-MoE from a ``transformers`` config, bf16, random
weights drawn once per process from one seed, sequence 4,096, every layer routed (64 experts,
top-8, a narrow expert so the all-to-all is a visible share of the step). The mesh is
``("pp", "edp", "ep")`` = (pp, 1, ep): every ep rank is a data-parallel replica with its own
micro-batches, dense gradients reduced over it (DDP), experts sharded over it
(``apply_expert_parallel``); experts run ``transformers``' grouped GEMM on Hopper in bf16
(``pipetrain.hf.experts_kernel``'s rule), the loop over experts on the CPU.

Rows share each launch: ``dualpipev+overlap``, ``dualpipev``, ``zbv``, ``1f1b``; each row builds
its pipeline from the same master weights, runs ``--warmup`` steps, then ``--steps`` timed
steps (barrier, synchronize, step with AdamW, synchronize; a step's time is the slowest rank's),
and is torn down before the next. ``--launches`` rounds run in one process group with the rows'
order rotated each round (the first row of one round is the second of the next), so every
row meets the machine at each position; each round counts as a launch for the 95% interval
(``moe_overlap_report``). Peak memory per rank: ``max_memory_allocated`` across the timed steps,
above what was allocated before the row's pipeline was built.

Before the runs, the simulator's prediction of each row (``moe_overlap_predict``) is printed and
stored. ``--profile`` is the second, short mode: per row, warm-up steps, then one step under
``torch.profiler``; each rank's trace is reduced to its exposed all-to-all
(``moe_overlap_trace``: all-to-all kernel time not covered by any compute kernel) and the
hidden share ``1 − exposed(dualpipev+overlap) / exposed(dualpipev)``. On the CPU the profile
still runs and reports the all-to-all op time from the CPU events, marked "cpu, not meaningful".

``--megatron`` adds Megatron-Core's combined 1F1B row (``moe_overlap_megatron``): it records why it
cannot run where it cannot. Every failure becomes an error row and the run goes on.

Writes ``results.json`` (or ``profile.json`` with ``--profile``) and ``table.md`` under ``--out``
and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.gpu_setup import GIB, slowest, time_steps
from benchmarks.common.local_launch import launch
from benchmarks.moe import moe_overlap_model as mm
from benchmarks.moe.moe_overlap_predict import measure_link_gbs, predict, profile_layers
from benchmarks.moe.moe_overlap_profile import profile_mode
from benchmarks.moe.moe_overlap_report import (
    PROFILE,
    RESULTS,
    summarize_timing,
    write_table,
)
from benchmarks.moe.moe_overlap_run import Run, guarded, optimizer


def time_row(run: Run, row: str) -> dict:
    """Warm-up, then the timed steps of one row: per-step times (s, slowest rank), peak GiB."""
    base = run.mem_reset()
    with run.pipeline(row) as pipe:
        opt = optimizer(pipe.parameters())

        def step() -> None:
            pipe.step(run.ids, run.ids)
            opt.step()
            opt.zero_grad(set_to_none=False)

        for _ in range(run.shape.warmup):
            step()
        run.sync()
        if run.cuda:
            torch.cuda.reset_peak_memory_stats(run.device)
        times = slowest(run, time_steps(run, step, run.shape.steps))
        peak = torch.cuda.max_memory_allocated(run.device) - base if run.cuda else None
    peaks = run.gather(peak)
    return {"times": times, "peak_gib": None if peak is None else [p / GIB for p in peaks]}


def rotated(rows: list[str], k: int) -> list[str]:
    k %= len(rows)
    return rows[k:] + rows[:k]


def timing_mode(run: Run, rows: list[str], save: Callable[[dict], None]) -> dict:
    """Every round (a launch for the interval) runs every row, in an order rotated by one each
    round; what is measured so far is handed to ``save`` after each round, so a call cut off by
    its wall limit still leaves the rounds it finished."""
    launches: dict[str, list] = {r: [] for r in rows}
    peaks: dict[str, list] = {}
    errors: dict[str, str] = {}
    out: dict = {}
    for k in range(run.shape.launches):
        for row in rotated(rows, k):
            if row in errors:
                continue
            got = guarded(run, row, lambda row=row: time_row(run, row))
            if "error" in got:
                errors[row] = got["error"]
                continue
            launches[row].append(got["times"])
            if got["peak_gib"]:
                before = peaks.get(row, got["peak_gib"])
                peaks[row] = [max(a, b) for a, b in zip(before, got["peak_gib"])]
            median = sorted(got["times"])[len(got["times"]) // 2]
            run.log(f"launch {k} {row}: median {1e3 * median:.1f} ms")
        out = timing_rows(rows, launches, peaks, errors)
        save(out)
    return out


def timing_rows(rows: list[str], launches: dict, peaks: dict, errors: dict) -> dict:
    summary = summarize_timing({r: v for r, v in launches.items() if v})
    out = {}
    for row in rows:
        out[row] = {"error": errors[row]} if row in errors else dict(summary.get(row, {}))
        out[row]["launches_ms"] = [[round(1e3 * t, 3) for t in x] for x in launches[row]]
        out[row]["peak_gib"] = peaks.get(row)
    return out


def prediction(run: Run, rows: list[str]) -> dict:
    """The simulator's prediction of every row (``moe_overlap_predict``), from rank 0's layer
    profile and the measured (or given) expert link; printed before the runs."""
    layers = profile_layers(run.shape, run.master, run.device)
    link = run.args.ep_link_gbs or measure_link_gbs(
        run.shape, run.mesh["ep"].get_group(), run.device
    )
    layers, link = run.gather((layers, link))[0]
    pred = predict(run.shape, rows, layers, link)
    pred["ep_link"] = "given" if run.args.ep_link_gbs else "measured"
    run.log(f"expert link {link:.3g} GB/s ({pred['ep_link']}); per micro-batch: {layers}")
    for row, p in pred["rows"].items():
        run.log(f"predicted {row}: {p['step_ms']:.1f} ms, hidden {100 * p['hidden_share']:.0f}%")
    return pred


def describe(run: Run, rows: list[str]) -> dict:
    import transformers

    s = run.shape
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name(run.device) if run.cuda else "cpu",
        "backend": dist.get_backend(),
        "world": run.world,
        "shape": dataclasses.asdict(s),
        "rows": rows,
        "argv": sys.argv,
        "step": "slowest rank's wall time of pipe.step + AdamW step; location = mean over "
        "launches of each launch's median, 95% interval by a two-level bootstrap",
    }


def start(args: argparse.Namespace, rank: int, world: int) -> int:
    shape = resolve_shape(args)
    run = Run(args, shape)
    out = Path(args.out)
    rows = [r for r in args.rows.split(",") if r]
    try:
        result: dict = {"meta": describe(run, rows), "prediction": prediction(run, rows)}
        extra: dict = {}
        if args.megatron:  # a probe, cheap: recorded first, kept whatever happens after
            from benchmarks.moe.moe_overlap_megatron import FALLBACK, MEGATRON_ROW, megatron_row

            extra[MEGATRON_ROW] = guarded(run, MEGATRON_ROW, lambda: megatron_row(run))
            result["notes"] = {MEGATRON_ROW: FALLBACK}

        def save(measured: dict) -> None:
            if rank == 0:
                result["rows"] = measured | extra
                out.mkdir(parents=True, exist_ok=True)
                name = PROFILE if args.profile else RESULTS
                (out / name).write_text(json.dumps(result, indent=1))

        if args.profile:
            measured, result["source"] = profile_mode(run, rows, out)
            save(measured)
        else:
            timing_mode(run, rows, save)
        if rank == 0:
            print(write_table(out), flush=True)
        run.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def resolve_shape(args: argparse.Namespace) -> mm.Shape:
    """The preset with the command line's overrides; a ``ValueError`` for what cannot run."""
    shape = mm.PRESETS[args.preset]
    given = {
        k: getattr(args, k) for k in ("pp", "ep", "microbatches", "steps", "warmup", "launches")
    }
    shape = dataclasses.replace(shape, **{k: v for k, v in given.items() if v is not None})
    if shape.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--preset {args.preset} needs CUDA GPUs; --preset cpu-smoke runs on gloo")
    if shape.experts % shape.ep:
        raise ValueError(f"--ep {shape.ep} must divide the {shape.experts} experts")
    if shape.microbatches < 2 * shape.pp:
        raise ValueError(f"--microbatches must be >= 2·pp = {2 * shape.pp} (DualPipeV's need)")
    return shape


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(mm.PRESETS), default="h200x4")
    ap.add_argument("--out", required=True, help="folder for results.json / profile.json, table.md")
    ap.add_argument("--profile", action="store_true", help="one profiled step per row (module doc)")
    ap.add_argument(
        "--rows", default=",".join(mm.ROWS), help="comma-separated, from: " + ", ".join(mm.ROWS)
    )
    ap.add_argument(
        "--predict-only",
        action="store_true",
        help="the simulator's prediction alone, one process, one device (needs --ep-link-gbs)",
    )
    ap.add_argument("--megatron", action="store_true", help="add Megatron-Core's combined 1F1B row")
    for name in ("pp", "ep", "microbatches", "steps", "warmup", "launches"):
        ap.add_argument(f"--{name}", type=int, help="default: the preset's")
    ap.add_argument("--ep-link-gbs", type=float, help="expert link GB/s (default: measured here)")
    ap.add_argument("--nproc", type=int, help="processes to spawn without torchrun (pp·ep)")
    ap.add_argument("--pg-timeout", type=float, default=600.0)
    ap.add_argument("--op-timeout", type=float, default=300.0)
    ap.add_argument(
        "--keep-traces",
        action="store_true",
        help="keep every rank's profile trace (default: rank 0's two DualPipeV rows)",
    )
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    bad = [r for r in args.rows.split(",") if r and r not in mm.ROWS]
    if bad:
        ap.error(f"unknown rows {bad}; legal: {', '.join(mm.ROWS)}")
    return args


def predict_only(args: argparse.Namespace, shape: mm.Shape) -> int:
    """The prediction alone, in this one process on one device (no process group): the layer
    profile on this device, the link from ``--ep-link-gbs``; for a machine with one GPU."""
    device = torch.device("cuda", 0) if shape.device == "cuda" else torch.device("cpu")
    rows = [r for r in args.rows.split(",") if r]
    layers = profile_layers(shape, mm.build_master(shape, device), device)
    pred = predict(shape, rows, layers, args.ep_link_gbs) | {"ep_link": "given"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prediction.json").write_text(json.dumps(pred, indent=1))
    print(f"per micro-batch (ms): {layers}")
    for row, p in pred["rows"].items():
        exposed = " / ".join(f"{x:.1f}" for x in p["exposed_ms"])
        print(
            f"{row}: {p['step_ms']:.1f} ms, all-to-all hidden {100 * p['hidden_share']:.0f}%, "
            f"exposed per rank {exposed} ms"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        shape = resolve_shape(args)
        if args.predict_only and not args.ep_link_gbs:
            raise ValueError("--predict-only needs --ep-link-gbs (no ep group to measure it on)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.predict_only:
        return predict_only(args, shape)
    args.nproc = args.nproc or shape.pp * shape.ep
    return launch(args, start)


if __name__ == "__main__":
    sys.exit(main())
