"""A ``pipetrain train`` worker that stopped on NCCL leaves at once (``launch._leave_without_teardown``):
no barrier and no group destruction, either of which waits forever for a peer blocked on the
device; the reason printed once, by rank 0 — or by another rank when rank 0 does not answer.
Plain gloo processes stand in for the NCCL workers (the exit path is host-side only)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from runtime_harness import free_port

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from pipetrain.app import launch
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
launch._SAID_WAIT_S = 1
if dist.get_rank() == 0 and sys.argv[1] == "blocked":
    time.sleep(60)  # rank 0 stuck (on the device, in a real run)
launch._leave_without_teardown(3, "pipetrain train: error: refused for a reason", sys.stderr)
"""


def _start(case: str) -> list[subprocess.Popen[str]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["WORLD_SIZE"], env["PYTHONPATH"] = "2", str(ROOT)
    return [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, case],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]


@pytest.mark.parametrize("case", ["together", "blocked"])
def test_a_stopped_worker_leaves_without_waiting_for_its_peers(case):
    procs = _start(case)
    t0 = time.monotonic()
    try:
        leaving = procs if case == "together" else procs[1:]
        codes = [p.wait(timeout=30) for p in leaving]
        took = time.monotonic() - t0
        said = [p.stderr.read() for p in leaving]  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert codes == [3] * len(leaving)
    assert took < 20, took  # start-up included; no wait for the blocked peer
    printed = [s.count("refused for a reason") for s in said]
    # together: rank 0 says it, rank 1 does not repeat it; blocked: rank 1 says it itself
    assert printed == ([1, 0] if case == "together" else [1])
