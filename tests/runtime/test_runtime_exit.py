"""A finished run exits 0, every time, and so does one whose checkpoint load was refused: the
README-shaped script run many times as real processes (the interpreter's own teardown is what is
tested, so no multiprocessing workers). ``benchmarks/exit_stress.py`` runs such jobs by the
hundred."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from runtime_harness import free_port

SCRIPT = Path(__file__).parents[1] / "support" / "runtime_exit_script.py"
RUNS = [  # (ranks, schedule, variant): 7 runs, most of them zb-h1 (where exits died most); the
    # hundreds are benchmarks/exit_stress.py's
    *((2, "zb-h1", variant) for variant in ("plain", "plain", "with", "destroy", "refused")),
    (2, "zbv", "plain"),
    (4, "zb-h1", "with"),
]


def _run(world: int, schedule: str, variant: str) -> list[tuple[int, str]]:
    with tempfile.TemporaryDirectory() as folder:
        return _run_in(world, schedule, variant, folder)


def _run_in(
    world: int, schedule: str, variant: str, folder: str, **extra_env: str
) -> list[tuple[int, str]]:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            PIPETRAIN_SCHEDULE=schedule,
            OMP_NUM_THREADS="1",
            **extra_env,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(SCRIPT), variant, os.path.join(folder, "ckpt")],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        results.append((p.returncode, err[-400:]))
    return results


@pytest.mark.slow
def test_the_readme_script_exits_zero_every_time():
    with ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda run: (run, _run(*run)), RUNS))
    failed = [
        f"{run}: rank {rank} exit {code}: {err}"
        for run, results in outcomes
        for rank, (code, err) in enumerate(results)
        if code != 0
    ]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
def test_nothing_of_the_job_is_left_for_the_interpreters_teardown(tmp_path):
    """After a README-style run the rendezvous store's server is gone before the interpreter's
    own teardown: every group destroyed, and nothing of the pipeline's (nor a module it imported,
    such as torch.distributed.fsdp) holding the store."""
    results = _run_in(2, "zb-h1", "plain", str(tmp_path), PIPETRAIN_EXIT_PROBE="1")
    assert [code for code, _ in results] == [0, 0], results
    assert "store server at exit: gone" in results[0][1], results[0][1]
