"""Every GPU measurement of the pipetrain-against-torch comparison in one command, for a machine
with 2 or 4 GPUs (NCCL), from anywhere::

    OUT=out/gpu python3 benchmarks/pipeline/run_gpu_all.py             # 2 GPUs
    NPROC=4 OUT=out/gpu4 python3 benchmarks/pipeline/run_gpu_all.py    # 4 GPUs

The plan (``sections``), each section under its own timeout with its own log under ``$OUT``
(default ``./out/gpu``), the whole within about 7.5 minutes:

1. ``gpu_equivalence.py`` (torchrun × NPROC): float64 gradients against the unsplit model and a
   30-step training run, on max(8, 2 × NPROC) micro-batches (DualPipeV needs ≥ 2 × ranks);
2. ``split_backward_gpu.py`` (one GPU): time(I) + time(W) against time(B) for one block;
3. ``gpu_pipeline.py`` (torchrun × NPROC): pipetrain against torch.distributed.pipelining.

The summary at the end repeats each section's table (on failure, its log's tail). Needs no
network and no installs: the package is imported from this checkout. ``EQ_ARGS``,
``SPLIT_ARGS``, ``BENCH_ARGS`` add arguments to a section; ``EQ_S``, ``SPLIT_S``, ``BENCH_S`` its
timeout; ``BUDGET_S`` (BENCH_S − 65) is where ``gpu_pipeline.py`` stops starting configurations;
``PYTHON`` the interpreter. Without CUDA the scripts fall back to gloo and small presets (a CPU
smoke run: ``NPROC=4 OUT=/tmp/g4 SPLIT_ARGS="--hidden 256 --heads 4 --seq 128 --reps 5"``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.call_steps import Clock, run_logged, tail, torchrun

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Section:
    """One step of the plan: its command, timeout and log, and the line its table starts at."""

    name: str
    argv: tuple[str, ...]
    limit_s: int
    log: str
    table: str


def sections(env: dict[str, str], out: str, python: str) -> list[Section]:
    """The plan: equivalence, split backward, the benchmark, in this order."""
    nproc = int(env.get("NPROC", "2"))
    bench_s = int(env.get("BENCH_S", "300"))
    budget_s = env.get("BUDGET_S", str(bench_s - 65))
    ranks = torchrun(python, nproc)
    equivalence = [*ranks, "benchmarks/runtime/gpu_equivalence.py", "--out", out]
    equivalence += ["--microbatches", str(max(8, 2 * nproc)), *shlex.split(env.get("EQ_ARGS", ""))]
    split = [python, "benchmarks/runtime/split_backward_gpu.py", "--out", out]
    split += shlex.split(env.get("SPLIT_ARGS", ""))
    bench = [*ranks, "benchmarks/pipeline/gpu_pipeline.py", "--out", out, "--budget-s", budget_s]
    bench += shlex.split(env.get("BENCH_ARGS", ""))
    return [
        Section(
            "equivalence",
            tuple(equivalence),
            int(env.get("EQ_S", "80")),
            "equivalence.log",
            "## equivalence",
        ),
        Section(
            "split-backward",
            tuple(split),
            int(env.get("SPLIT_S", "60")),
            "split_backward.log",
            "## split backward",
        ),
        Section("pipeline", tuple(bench), bench_s, "pipeline.log", "## gpu_pipeline"),
    ]


def summarise(log: Path, table: str) -> str:
    """The table a script prints last, without warnings; on failure its log's last lines."""
    lines = tail(log, 10**9)
    starts = [i for i, line in enumerate(lines) if line.startswith(table)]
    if not starts:
        last = "\n".join(line[:400] for line in lines[-25:])
        return f"(no table in {log}; its last lines:)\n{last}"
    noise = re.compile(r"^\[W|^W[0-9]|Warning|warn\(")
    return "\n".join(ln for ln in lines[starts[0] :] if not noise.search(ln))[:6000]


def main() -> None:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(ROOT) + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    os.chdir(ROOT)
    out = Path(env.get("OUT", "./out/gpu"))
    out.mkdir(parents=True, exist_ok=True)
    python = env.get("PYTHON", sys.executable)
    clock = Clock()
    probe = "import torch; n = torch.cuda.device_count(); print('torch', torch.__version__, "
    probe += (
        "'cuda', torch.version.cuda, 'gpus', n, [torch.cuda.get_device_name(i) for i in range(n)])"
    )
    subprocess.run([python, "-c", probe], env=env, check=False)
    plan = sections(env, str(out), python)
    for section in plan:
        started = clock.seconds()
        print(f"=== {section.name} (timeout {section.limit_s}s) ===", flush=True)
        rc = run_logged(section.argv, section.limit_s, out / section.log, env)
        took, now = clock.seconds() - started, clock.seconds()
        print(
            f"=== {section.name}: exit {rc} after {took}s (total {now}s); log {out / section.log} ==="
        )
        if rc == 124:
            print(f"!!! {section.name} timed out after {section.limit_s}s")
    print(
        f"\n################ summary ({clock.seconds()}s in all; files in {out}) ################"
    )
    for section in plan:
        if section.name == "pipeline":
            errors = [
                ln for ln in tail(out / section.log, 10**9) if "ERROR" in ln or "skipped" in ln
            ]
            print("\n".join(line[:300] for line in errors[:20]))
        print(summarise(out / section.log, section.table), end="\n\n")
    for path in sorted(out.iterdir()):
        print(f"{path.stat().st_size:>12} {path.name}")


if __name__ == "__main__":
    main()
