"""One GPU call for the compile and float8 targets (docs/benchmarks.md, "torch.compile and float8
under the pipeline"): per preset, ``LAUNCHES`` launches of ``compile_float8_gpu.py``'s unsplit
part (GPU 0 alone) and pipeline part (2 GPUs, ``SCHEDULE``), the variants' order rotated per
launch (``rotated``) so that no variant always runs first, every first step compiling from
scratch; after each launch ``compile_float8_report.py`` pools the launches so far into the targets
with 95% intervals (``$OUT/summary.md``). Run from the repository root with .whl/ holding the
torchao wheel::

    OUT=... PRESETS=h2048,h4096 LAUNCHES=3 python3 benchmarks/runtime/compile_float8_call.py

``SUFFIX=/precompile`` runs the pipeline's variants with ``Pipeline(precompile=True)`` (the report
shows them as their own split); ``STEPS`` (20) timed steps; ``LIMIT`` (150) seconds a part may
take (a stalled first step prints every thread's stack 20 s before)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.call_steps import run_logged, torchrun

SCRIPT = "benchmarks/runtime/compile_float8_gpu.py"
REPORT = "benchmarks/runtime/compile_float8_report.py"
ORDER = ("eager", "compile", "compile+float8")


@dataclass(frozen=True)
class Launch:
    """One launch of one preset: both parts, with the variants in this launch's order."""

    preset: str
    launch: int
    variants: tuple[str, ...]


def rotated(launch: int, order: tuple[str, ...] = ORDER) -> tuple[str, ...]:
    """Launch k starts at variant k mod len(order) and wraps around."""
    k = launch % len(order)
    return order[k:] + order[:k]


def plan(presets: str, launches: int) -> list[Launch]:
    return [
        Launch(preset, k, rotated(k))
        for preset in presets.split(",")
        if preset
        for k in range(launches)
    ]


def parts(one: Launch, env: dict[str, str], python: str) -> list[tuple[str, list[str], dict]]:
    """The unsplit part on GPU 0 alone, then the pipeline part on 2 GPUs."""
    limit, steps = int(env.get("LIMIT", "150")), env.get("STEPS", "20")
    suffix = env.get("SUFFIX", "")
    common = ["--preset", one.preset, "--launch", str(one.launch), "--steps", steps]
    common += ["--stall-dump-s", str(limit - 20), "--out", env["OUT"]]
    unsplit = [python, SCRIPT, "--part", "unsplit", *common, "--variants", ",".join(one.variants)]
    pipeline = [*torchrun(python, 2), SCRIPT, "--part", "pipeline", *common]
    pipeline += ["--schedule", env.get("SCHEDULE", "zbv")]
    pipeline += ["--variants", ",".join(v + suffix for v in one.variants)]
    return [("unsplit", unsplit, {"CUDA_VISIBLE_DEVICES": "0"}), ("pipeline", pipeline, {})]


def main() -> None:
    if not os.environ.get("OUT"):
        sys.exit("set OUT")
    env = dict(os.environ)
    out = Path(env["OUT"])
    out.mkdir(parents=True, exist_ok=True)
    wheels = sorted(Path(".whl").glob("*.whl"))
    if wheels:
        pip = ["python3", "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        subprocess.run([*pip, "--target", "/tmp/site", *map(str, wheels)], check=False)
    env |= {"PYTHONPATH": "/tmp/site:.", "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    env |= {"TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    env["TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"] = "false"
    with (out / "env.txt").open("w") as txt:
        subprocess.run(["nvidia-smi", "-L"], stdout=txt, stderr=subprocess.STDOUT, check=False)
    limit = int(env.get("LIMIT", "150"))
    for one in plan(env.get("PRESETS", "h2048"), int(env.get("LAUNCHES", "3"))):
        print(f"== {one.preset} launch {one.launch} ({','.join(one.variants)})", flush=True)
        for name, argv, extra in parts(one, env, "python3"):
            rc = run_logged(argv, limit, out / "log.txt", env | extra, kill_after_s=5, append=True)
            print(f"   {name} rc={rc}", flush=True)
        rows = sorted(map(str, out.glob("compile_float8-*.jsonl")))
        with (out / "summary.md").open("w") as summary:
            subprocess.run(["python3", REPORT, *rows], stdout=summary, stderr=summary, check=False)
    print((out / "summary.md").read_text() if (out / "summary.md").exists() else "(no summary)")


if __name__ == "__main__":
    main()
