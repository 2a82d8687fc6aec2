"""Clean exits, counted: run a 2-rank job as real processes many times and count how each
process ended (0, another status, a signal such as SIGABRT).

    python benchmarks/runtime/exit_stress.py --runs 100 --case finished   # README-style, no destroy
    python benchmarks/runtime/exit_stress.py --runs 50 --case refused      # a refused load, then exit

``finished``: the README's example as a user writes it (``init_process_group``, a Pipeline,
steps, one measured; no ``close``, no ``destroy_process_group``). ``refused``: the same, then
``load_checkpoint`` of a shallower model's checkpoint, which every rank refuses (a missing key); the script catches
the refusal and exits. What is tested is the interpreter's own teardown, so each rank is a
fresh process (no multiprocessing). Prints one line per outcome and a summary; exits 1 if any
process ended otherwise than with status 0.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CASES = ("finished", "refused")

WORKER = r"""
import os, sys, torch, torch.distributed as dist
from torch import nn
import pipetrain

torch.set_num_threads(1)
case, folder = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
torch.manual_seed(0)
def stages(depth):
    return [nn.Sequential(*(nn.Linear(16, 16) for _ in range(depth))) for _ in range(2)]
x, y = torch.randn(16, 16), torch.randn(16, 16)
pipe = pipetrain.Pipeline(stages(2), "zb-h1", 8, nn.functional.mse_loss)
for _ in range(3):
    pipe.step(x, y)
    with torch.no_grad():
        for p in pipe.parameters():
            p -= 0.01 * p.grad
            p.grad = None
pipe.step(x, y, timeline=True)
if case == "refused":
    shallow = pipetrain.Pipeline(stages(1), "zb-h1", 8, nn.functional.mse_loss)
    pipetrain.save_checkpoint(folder, shallow)
    try:
        pipetrain.load_checkpoint(folder, pipe)
        sys.exit("the load was not refused")
    except (KeyError, ValueError):
        pass
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(script: Path, case: str, root: Path) -> list[int]:
    """Both ranks' exit statuses (negative: the signal that ended it)."""
    port, folder = str(_port()), tempfile.mkdtemp(dir=root)
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a fatal signal prints where Python was
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), case, str(Path(folder) / "ckpt")],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    codes = []
    for rank, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        codes.append(p.returncode)
        if p.returncode:
            said = err.decode(errors="replace").strip().splitlines()
            print(f"  rank {rank}: {describe(p.returncode)}; its stderr ends:", flush=True)
            print("\n".join(f"    {line[:200]}" for line in said[-60:]), flush=True)
    return codes


def describe(code: int) -> str:
    if code < 0:
        return signal.Signals(-code).name
    return f"exit {code}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--case", choices=CASES, default="finished")
    parser.add_argument("--parallel", type=int, default=1, help="runs at a time")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        script = root / "worker.py"
        script.write_text(WORKER)
        t0 = time.monotonic()
        with ThreadPoolExecutor(args.parallel) as pool:
            results = list(pool.map(lambda _: one_run(script, args.case, root), range(args.runs)))
    counts = collections.Counter(describe(c) for codes in results for c in codes)
    print(
        f"{args.case}: {args.runs} runs, {2 * args.runs} processes in "
        f"{time.monotonic() - t0:.0f} s: "
        + ", ".join(f"{n} {what}" for what, n in sorted(counts.items()))
    )
    return 0 if set(counts) == {"exit 0"} else 1


if __name__ == "__main__":
    sys.exit(main())
