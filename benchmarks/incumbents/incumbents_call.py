"""One GPU call for docs/incumbents.md: ``incumbents.py`` in parts, the most needed first, inside
one wall budget (``TOTAL`` seconds, default 540). The plans are data in
``incumbents_call_plans.py`` (``PLAN`` picks one); this runs one: each part one launch under its
own timeout, ``summary.md`` pooling every launch with 95% intervals (``incumbents_stats.py``).

Run from a folder holding pipetrain/, benchmarks/ and .whl/ (the carried wheels of megatron-core,
deepspeed and their needs; the GPU machine has no internet), with ``$OUT`` set::

    PLAN=issue21 TOTAL=540 OUT=/out python3 benchmarks/incumbents/incumbents_call.py

Settings, all from the environment: ``ONLY=name1,name2`` runs only those parts; ``TUNED=FILE``
gives launches 1 and 2 an earlier launch 0 to pick Megatron's fastest interleaved variants from;
``STEPS`` (20) the timed steps; ``LAUNCHES`` (3) and ``FIRST_LAUNCH`` (0) how many launches the
rotated plans run and where their numbering starts, so two calls' launches pool as one series;
``PREHEAT=S`` keeps the GPUs busy S seconds before each launch's first row; ``ALLOC_CONF``
(``expandable_segments:True``; empty: the default allocator, which ``cuda_graph=True`` needs);
``WHEELS`` (.whl; ``none`` with ``EXTRA_PATH`` on a CPU check), ``PYTHON`` (python3).

What comes back (the device tool returns at most 8 files): ``env.txt``, ``summary.md`` (pooled
tables, intervals and target lines so far), ``clocks.md`` (each row's mean SM clock and power:
``incumbents_clocks.py``), ``results.tar.gz`` (each part's incumbents.json, log and SM clock
samples) and ``traces-<lib>.tar``, all rewritten after each part, so a part cut off by its
timeout still leaves the rows it finished. CPU check of the plumbing (gloo, tiny shapes)::

    OUT=/tmp/o WIDE=wide-tiny GPT=gpt-tiny BLOCKS=blocks-tiny LLAMA=llama-tiny NPROC4=2 \\
        STEPS=3 WHEELS=none EXTRA_PATH=/tmp/incsite PYTHON=.venv/bin/python PLAN=issue21 \\
        python3 benchmarks/incumbents/incumbents_call.py
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.call_steps import Clock, run_logged, tail, torchrun
from benchmarks.incumbents.incumbents_call_plans import Part, Settings, plan

SCRIPT = "benchmarks/incumbents/incumbents.py"
EXACT = "benchmarks/runtime/gpu_equivalence.py"
#: seconds kept at the end to pack the results
PACK_S = 10
#: a part starts only with this much of the call left
MIN_PART_S = 45
_HARNESS_LINE = re.compile(r"^\[ *[0-9.]+s\]")


class Call:
    """One call's state: where parts write, the environment they run in, the wall clock."""

    def __init__(self, out: Path, env: dict[str, str], total_s: int) -> None:
        self.out, self.env, self.total_s = out, env, total_s
        self.python = env.get("PYTHON", "python3")
        self.work = Path(tempfile.mkdtemp(prefix="incumbents.", dir="/tmp"))
        self.clock = Clock()
        self.only = {n for n in env.get("ONLY", "").split(",") if n}

    def left(self) -> int:
        return self.total_s - self.clock.seconds() - PACK_S


def environment(base: dict[str, str]) -> dict[str, str]:
    """The parts' environment: the carried wheels installed first (exit 3 when that fails), one
    allocator and NCCL setting for every library, NVLink multicast off."""
    env = dict(base)
    python, wheels = env.get("PYTHON", "python3"), Path(env.get("WHEELS", ".whl"))
    path = "."
    if wheels.is_dir():
        pip = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        pip += ["--no-cache-dir", "--upgrade", "--target", "/tmp/site"]
        if subprocess.run([*pip, *map(str, sorted(wheels.glob("*.whl")))], check=False).returncode:
            sys.exit(3)
        path = "/tmp/site:."
    env["PYTHONPATH"] = path + (f":{env['EXTRA_PATH']}" if env.get("EXTRA_PATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTORCH_CUDA_ALLOC_CONF"] = env.get("ALLOC_CONF", "expandable_segments:True")
    if shutil.which("nvidia-smi"):  # the carried DeepSpeed wheel was built on a CPU box
        env["DS_ACCELERATOR"] = "cuda"
    env |= {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env["NVSHMEM_DISABLE_NVLS"] = "1"
    return env


_VERSIONS = """
import importlib.metadata as m
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None)
for d in ("megatron-core", "deepspeed", "pydantic", "triton"):
    try:
        print(d, m.version(d))
    except m.PackageNotFoundError:
        print(d, "absent")
"""


def write_env(call: Call) -> None:
    """``env.txt``: the date, the GPUs and their links, the libraries' versions, the commit."""
    commands = [["date", "-u"], ["nvidia-smi", "-L"], ["nvidia-smi", "topo", "-m"]]
    commands += [[call.python, "-c", _VERSIONS], ["git", "log", "-1", "--format=commit %H %s"]]
    with (call.out / "env.txt").open("w") as out:
        for argv in commands:
            try:
                subprocess.run(
                    argv, stdout=out, stderr=subprocess.STDOUT, env=call.env, check=False
                )
            except FileNotFoundError:
                out.write(f"{argv[0]}: not found\n")
            out.flush()
    print("\n".join(tail(call.out / "env.txt", 6)))


def pack(call: Call, resamples: int = 300) -> None:
    """Everything so far into ``$OUT`` (few files, each rewritten whole)."""
    jsons = sorted(map(str, call.work.glob("*/incumbents.json")))
    env = call.env | {"INCUMBENTS_RESAMPLES": str(resamples)}
    stats = "benchmarks/incumbents/incumbents_stats.py"
    if jsons:  # no torch import: a second or two
        with (call.out / "summary.md").open("w") as out:
            subprocess.run(
                [call.python, stats, *jsons], stdout=out, stderr=out, env=env, check=False
            )
    with (call.out / "clocks.md").open("w") as out:
        clocks = "benchmarks/incumbents/incumbents_clocks.py"
        subprocess.run([call.python, clocks, str(call.work)], stdout=out, stderr=out, check=False)
    with tarfile.open(call.out / "results.tar.gz", "w:gz") as tar:
        for path in sorted(call.work.rglob("*")):
            if path.is_file() and not path.name.endswith(".json.gz"):
                tar.add(path, arcname=f"./{path.relative_to(call.work)}")
    for lib in ("megatron", "pipetrain", "torch", "deepspeed"):
        traces = sorted(call.work.glob(f"*/trace-*-{lib}*-r*.json.gz"))
        if traces:
            with tarfile.open(call.out / f"traces-{lib}.tar", "w") as tar:
                for path in traces:
                    tar.add(path, arcname=f"./{path.relative_to(call.work)}")


def fitted(part: Part, left: int) -> tuple[int, int]:
    """The part's harness budget and timeout, cut to the time the call has left: the timeout adds
    start-up and one overrunning row to the budget (30 s)."""
    limit = left if part.limit_s is None else min(part.limit_s, left)
    budget = left - 30 if part.budget_s is None else part.budget_s
    return min(budget, limit - 30), limit


def run_part(call: Call, part: Part) -> None:
    """One part, if it is asked for and still fits the call; the SM clock, power and temperature
    sampled every 200 ms while it runs (``incumbents_clocks.py`` lines them up with the rows)."""
    if call.only and part.name not in call.only:
        return
    left = call.left()
    if left < (part.limit_s if part.exact and part.limit_s else MIN_PART_S):
        print(f"== {part.name} skipped: {left}s left", flush=True)
        return
    budget, limit = fitted(part, left)
    at = call.clock.seconds()
    said = f"timeout {limit}s" if part.exact else f"budget {budget}s, timeout {limit}s"
    print(f"== {part.name}: {said}, at {at}s", flush=True)
    log = call.work / f"{part.name}.log"
    sampler = None
    if shutil.which("nvidia-smi") and not part.exact:
        query = "--query-gpu=timestamp,index,clocks.sm,power.draw,temperature.gpu"
        smi = ["nvidia-smi", query, "--format=csv,noheader,nounits", "-lms", "200"]
        with (call.work / f"{part.name}.smi.csv").open("w") as samples:
            sampler = subprocess.Popen(smi, stdout=samples, stderr=subprocess.DEVNULL)
    rc = run_logged(command(call, part, budget), limit, log, part_env(call, part, limit))
    print(f"== {part.name} rc={rc} at {call.clock.seconds()}s", flush=True)
    if sampler is not None:
        sampler.kill()
        sampler.wait()
    lines = tail(log, 10**9)
    if part.exact:
        shown = _after(lines, "## equivalence", 9)
    else:
        shown = [ln for ln in lines if _HARNESS_LINE.match(ln) and ": ERROR" not in ln][-40:]
    print("\n".join(shown), flush=True)
    pack(call)


def _after(lines: list[str], marker: str, count: int) -> list[str]:
    for i, line in enumerate(lines):
        if line.startswith(marker):
            return lines[i : i + count]
    return []


def command(call: Call, part: Part, budget: int) -> list[str]:
    launcher = torchrun(call.python, part.nproc)
    out = str(call.work / part.name)
    if part.exact:
        schedules = "1f1b,interleaved-1f1b,zbv,dualpipev+overlap"
        return [*launcher, EXACT, "--schedules", schedules, "--train-steps", "10", "--out", out]
    preheat = ["--preheat-s", call.env["PREHEAT"]] if call.env.get("PREHEAT") else []
    return [*launcher, SCRIPT, "--out", out, "--budget-s", str(budget), *preheat, *part.args]


def part_env(call: Call, part: Part, limit: int) -> dict[str, str]:
    """Every rank prints its threads' stacks shortly before the timeout: a hang shows where."""
    return call.env if part.exact else call.env | {"STACKS_AFTER": str(limit - 12)}


def main() -> None:
    if not os.environ.get("OUT"):
        sys.exit("set OUT to the folder for results")
    try:
        total = int(os.environ.get("TOTAL", "540"))
        call = Call(Path(os.environ["OUT"]), environment(dict(os.environ)), total)
        parts = plan(call.env.get("PLAN", "issue13"), Settings.from_env(call.env, str(call.work)))
    except ValueError as error:
        sys.exit(f"error: {error}")
    call.out.mkdir(parents=True, exist_ok=True)
    write_env(call)
    for part in parts:
        run_part(call, part)
    pack(call, 2000)  # the final summary: 2000 bootstrap draws per interval
    print(f"== done at {call.clock.seconds()}s (TOTAL {total}s)")
    summary = [ln for ln in tail(call.out / "summary.md", 10**9) if ln.strip()]
    print("\n".join(summary[:150]))
    for path in sorted(call.out.iterdir()):
        print(f"{path.stat().st_size:>12} {path.name}")
    shutil.rmtree(call.work, ignore_errors=True)


if __name__ == "__main__":
    main()
