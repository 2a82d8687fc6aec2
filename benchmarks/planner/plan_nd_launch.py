"""How ``plan_nd_gpu.py`` runs things: the model's flags shared by ``pipetrain profile`` and
``pipetrain train``, one profile, one training launch of a plan (``pipetrain train --plan``) read
back into its timed steps, every run's launches in rotated order (``measure``), and the float64 check of a program (``plan_program_equivalence``).
Standard library only: every command is a process of its own under a timeout
(``benchmarks.common.call_steps.run_logged``), its output in a log beside the results.

A launch's step times come from its ``--metrics`` file: each record's ``tokens / tok_per_s`` is
the wall time ``pipetrain train`` measured around that step on rank 0 (the learning rate set, the
gradients zeroed, ``Pipeline.step`` with its data-parallel sync, the gradient norm, AdamW's
update), so what a user's job pays per step. The run's last steps record a timeline of every
action (``TIMELINE_STEPS``, run on top of the timed ones and left out of them); its report's
"measured step" line, the median makespan of those, is the pipeline's step alone, which is what
the planner's pipeline prediction prices.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from benchmarks.common.call_steps import run_logged, tail, torchrun
from benchmarks.planner.plan_nd_report import format_report, summarize

#: the run report's line with the measured pipeline step (``app.report``)
MEASURED_LINE = re.compile(
    r"^measured step:\s+makespan\s+([0-9.]+) ms.*?the median of the last (\d+) steps", re.MULTILINE
)
#: the steps ``pipetrain train`` runs last with ``timeline=True`` (recording every action, for
#: its report's measured step): run on top of the timed steps and left out of them, since the
#: recording is not what a step pays (the report line says how many it recorded)
TIMELINE_STEPS = 5


@dataclass(frozen=True)
class Model:
    """A model ``pipetrain profile`` and ``pipetrain train`` build alike from flags."""

    model: str
    blocks: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    micro_batch_size: int
    dtype: str
    tie_embeddings: bool = False

    def flags(self) -> list[str]:
        out = [
            "--model",
            self.model,
            "--layers",
            str(self.blocks),
            "--hidden",
            str(self.hidden),
            "--heads",
            str(self.heads),
            "--kv-heads",
            str(self.kv_heads),
            "--vocab",
            str(self.vocab),
            "--seq-len",
            str(self.seq_len),
            "--microbatch-size",
            str(self.micro_batch_size),
            "--dtype",
            self.dtype,
        ]
        return out + (["--tie-embeddings"] if self.tie_embeddings else [])


CHECKOUT = Path(__file__).resolve().parents[2]


def checkout_env() -> dict[str, str]:
    """The environment with this checkout first on ``PYTHONPATH``: ``python -m pipetrain`` and
    the workers import this tree's pipetrain from whatever folder the benchmark was started in."""
    paths = [str(CHECKOUT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return os.environ | {"PYTHONPATH": os.pathsep.join(paths)}


def pipetrain(python: str) -> list[str]:
    return [python, "-m", "pipetrain"]


def profile(
    python: str,
    model: Model,
    out: Path,
    *,
    device: str,
    tp: tuple[int, ...] = (1,),
    link_gbs: float | None = None,
    repeats: int = 5,
    limit_s: int = 600,
) -> dict:
    """``pipetrain profile`` of ``model`` at the tensor-parallel degrees ``tp`` into ``out``;
    the costs file's JSON. ``RuntimeError`` with the log's tail where it failed."""
    argv = [
        *pipetrain(python),
        "profile",
        *model.flags(),
        "--device",
        device,
        "--repeats",
        str(repeats),
        "--out",
        str(out),
        "--tp",
        ",".join(map(str, tp)),
    ]
    if link_gbs is not None and max(tp) > 1:
        argv += ["--link-gbs", f"{link_gbs:g}"]
    log = out.with_suffix(".log")
    code = run_logged(argv, limit_s, log, env=checkout_env())
    if code != 0:
        raise RuntimeError(f"profile exited {code}: " + " | ".join(tail(log, 5)))
    return json.loads(out.read_text())


def train_launch(
    python: str,
    model: Model,
    plan_file: Path,
    folder: Path,
    *,
    device: str,
    warmup: int,
    steps: int,
    limit_s: int,
) -> dict:
    """One launch of ``pipetrain train --plan plan_file``: ``warmup`` untimed steps, ``steps``
    timed ones (``steps_ms``), ``TIMELINE_STEPS`` recorded ones (``pipeline_ms``) and the
    global micro-batches a step carries; ``{"error": ...}`` where the launch failed."""
    plan = json.loads(plan_file.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    metrics = folder / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    argv = [
        *pipetrain(python),
        "train",
        "--plan",
        str(plan_file),
        *model.flags(),
        "--tp",
        str(plan.get("tp", 1)),
        "--dp",
        str(plan.get("dp", 1)),
        "--steps",
        str(warmup + steps + TIMELINE_STEPS),
        "--metrics",
        str(metrics),
        "--device",
        device,
        "--svg",
        str(folder / "step.svg"),
        "--corpus-out",
        str(folder / "corpus.txt"),
    ]
    log = folder / "train.log"
    code = run_logged(argv, limit_s, log, env=checkout_env())
    if code != 0:
        return {"error": f"exit {code}: " + " | ".join(tail(log, 4))}
    return read_launch(metrics, log, warmup) | {
        "global_microbatches": plan["microbatches"] * plan.get("dp", 1)
    }


def read_launch(metrics: Path, log: Path, warmup: int) -> dict:
    """A finished launch's timed steps (ms: after ``warmup``, before the steps its report
    recorded with a timeline) and its measured pipeline step."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    found = MEASURED_LINE.search(log.read_text(errors="replace"))
    recorded = int(found.group(2)) if found else 0
    last = max((r["step"] for r in records), default=0) - recorded
    timed = [r for r in records if warmup < r["step"] <= last]
    if not timed:
        return {
            "error": f"no step between the {warmup} warm-up and the {recorded} recorded "
            f"steps in {metrics}"
        }
    return {
        "steps_ms": [r["tokens"] / r["tok_per_s"] * 1e3 for r in timed],
        "pipeline_ms": float(found.group(1)) if found else None,
    }


def equivalence(
    python: str,
    plan_file: Path,
    model: Model,
    out: Path,
    *,
    ranks: int,
    device: str,
    limit_s: int = 300,
) -> dict:
    """The float64 check of ``plan_file``'s program (``plan_program_equivalence``) on ``ranks``
    processes; its result, or ``{"error": ...}``."""
    script = Path(__file__).resolve().parent / "plan_program_equivalence.py"
    argv = [
        *torchrun(python, ranks),
        str(script),
        "--plan",
        str(plan_file),
        "--blocks",
        str(model.blocks),
        "--out",
        str(out),
        "--device",
        "cpu" if device == "cpu" else "auto",
    ]
    if model.tie_embeddings:
        argv.append("--tie-embeddings")
    out.unlink(missing_ok=True)
    log = out.with_suffix(".log")
    code = run_logged(argv, limit_s, log, env=checkout_env())
    if not out.exists():
        return {"error": f"exit {code}: " + " | ".join(tail(log, 4)), "ok": False}
    return json.loads(out.read_text())


def measure(
    args,
    out: Path,
    model: Model,
    runs: list[dict],
    launches: dict,
    meta: dict,
    started: float,
    mode: str,
    extra: dict | None = None,
) -> dict:
    """The launches each run lacks (``args.launches`` of each, ``args.device``,
    ``args.launch_s`` seconds at most each), the runs' order rotated by one each launch; the
    report rewritten after each."""
    report: dict = {}
    meta.pop("stopped", None)  # a --resume's own stop, if any, is said anew
    for k in range(args.launches):
        order = runs[k % len(runs) :] + runs[: k % len(runs)]
        for run in order:
            if len(launches[run["name"]]) > k:
                continue  # measured before a --resume
            if time.monotonic() - started > args.budget_s:
                meta["stopped"] = f"--budget-s {args.budget_s:g} reached in launch {k}"
                break
            folder = out / "launches" / str(k) / slug(run["name"])
            got = train_launch(
                sys.executable,
                model,
                Path(run["plan_file"]),
                folder,
                device=args.device,
                warmup=args.warmup,
                steps=args.steps,
                limit_s=args.launch_s,
            )
            got["order"] = order.index(run)
            launches[run["name"]].append(got)
            print(f"launch {k} {run['name']}: " + launch_line(got), flush=True)
            report = write(out, mode, runs, launches, meta, extra)
    report = write(out, mode, runs, launches, meta, extra)
    print(format_report(report), flush=True)
    return report


def launch_line(got: dict) -> str:
    if "error" in got:
        return got["error"][:200]
    steps = sorted(got["steps_ms"])
    return f"median step {steps[len(steps) // 2]:.2f} ms over {len(steps)} steps"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-")


def write(out: Path, mode, runs, launches, meta, extra=None) -> dict:
    """``report.json`` (with what ``--resume`` needs) and ``summary.txt``."""
    report = summarize(mode, runs, launches, meta) | (extra or {})
    saved = report | {"plan_runs": runs, "launches_by_run": launches, "meta": meta}
    # whole or not at all: a call killed at its wall limit mid-write leaves the last report
    part = out / "report.json.part"
    part.write_text(json.dumps(saved, indent=1) + "\n")
    part.replace(out / "report.json")
    (out / "summary.txt").write_text(format_report(report) + "\n")
    return report
