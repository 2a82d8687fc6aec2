"""One 4-GPU call: does a captured step run on 4 ranks, and with expandable segments? The runs
(``STEPS``, in this order), each under its own timeout and with every rank's stacks dumped before
it (a hang shows where it waits):

* ``probe4``: NCCL sends/receives on two groups captured and replayed, 4 ranks, alone;
* ``exact4-zbv``: the float64 graph-against-eager check of ``cuda_graph_gpu.py``, ZBV, 4 ranks,
  default allocator; ``exact2-exp`` and ``exact4-exp``: the same on 2 and on 4 ranks with
  ``expandable_segments:True``; ``exact4-all``: every other family on 4 ranks;
* ``speed4``: eager against graph on 4 ranks, both shapes, ZBV, DualPipeV and interleaved 1F1B.

What comes back: ``$OUT/summary.txt`` (each run's return code and last lines) and
``$OUT/logs.tar.gz``::

    OUT=... python3 benchmarks/runtime/cuda_graph_x4_call.py
"""

from __future__ import annotations

import os
import re
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.call_steps import run_logged, tail, torchrun

SCRIPT = "benchmarks/runtime/cuda_graph_gpu.py"
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
FAMILIES = "1f1b,interleaved-1f1b,zb-h1,interleaved-zb,zbv+replayw,dualpipev,dualpipev+overlap"


@dataclass(frozen=True)
class Step:
    name: str
    nproc: int
    limit_s: int
    args: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)


STEPS = [
    Step("probe4", 4, 50, ("--part", "probe", "--stacks-after", "40")),
    Step("exact4-zbv", 4, 100, ("--part", "exact", "--schedules", "zbv", "--stacks-after", "85")),
    Step(
        "exact2-exp",
        2,
        80,
        ("--part", "exact", "--schedules", "zbv", "--allow-expandable", "--stacks-after", "65"),
        {"CUDA_VISIBLE_DEVICES": "0,1", **EXPANDABLE},
    ),
    Step(
        "exact4-exp",
        4,
        80,
        ("--part", "exact", "--schedules", "zbv", "--allow-expandable", "--stacks-after", "65"),
        EXPANDABLE,
    ),
    Step(
        "exact4-all", 4, 130, ("--part", "exact", "--stacks-after", "115", "--schedules", FAMILIES)
    ),
    Step(
        "speed4",
        4,
        150,
        (
            "--part",
            "speed",
            "--stacks-after",
            "140",
            "--rounds",
            "2",
            "--steps",
            "15",
            "--speed-schedules",
            "zbv,dualpipev,interleaved-1f1b",
        ),
    ),
]
_SHOWN = re.compile(r"probe:|exact |speed |Error|error")


def main() -> None:
    if not os.environ.get("OUT"):
        sys.exit("set OUT")
    out = Path(os.environ["OUT"])
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ) | {"PYTHONPATH": ".", "PYTHONUNBUFFERED": "1", "NCCL_NVLS_ENABLE": "0"}
    env["TORCH_NCCL_SHOW_EAGER_INIT_P2P_SERIALIZATION_WARNING"] = "false"

    def said(text: str) -> None:
        print(text, flush=True)
        with (out / "summary.txt").open("a") as summary:
            summary.write(text + "\n")

    said(os.popen("nvidia-smi -L 2>&1").read().rstrip())
    for step in STEPS:
        said(f"=== {step.name} {time.strftime('%H:%M:%S', time.gmtime())}")
        argv = [*torchrun("python3", step.nproc), SCRIPT, *step.args]
        argv += ["--out", str(out / "logs" / step.name)]
        log = out / "logs" / f"{step.name}.log"
        rc = run_logged(argv, step.limit_s, log, env | step.env, kill_after_s=5)
        said(f"rc={rc} {time.strftime('%H:%M:%S', time.gmtime())}")
        shown = [line[:400] for line in tail(log, 10**9) if _SHOWN.search(line)][-12:]
        said("\n".join(shown))
        with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
            tar.add(out / "logs", arcname="logs")


if __name__ == "__main__":
    main()
