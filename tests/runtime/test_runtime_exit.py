"""A finished run exits 0, every time, and so does one whose checkpoint load was refused: the
README-shaped script run many times as real processes (the interpreter's own teardown is what is
tested, so no multiprocessing workers). ``benchmarks/runtime/exit_stress.py`` runs such jobs by the
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
RUNS = [  # (ranks, schedule, variant, probe): 7 runs, most of them zb-h1 (where exits died
    # most); the hundreds are benchmarks/runtime/exit_stress.py's. The first also probes the store's
    # server from the last exit handler (test_nothing_of_the_job_is_left_...)
    (2, "zb-h1", "plain", True),
    *((2, "zb-h1", variant, False) for variant in ("plain", "with", "destroy", "refused")),
    (2, "zbv", "plain", False),
    (4, "zb-h1", "with", False),
]


def _run(world: int, schedule: str, variant: str, probe: bool) -> list[tuple[int, str]]:
    extra_env = {"PIPETRAIN_EXIT_PROBE": "1"} if probe else {}
    with tempfile.TemporaryDirectory() as folder:
        return _run_in(world, schedule, variant, folder, **extra_env)


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


@pytest.fixture(scope="module")
def outcomes() -> list[tuple[tuple, list[tuple[int, str]]]]:
    """Every run of ``RUNS`` (four at a time): (run, each rank's (exit status, end of stderr))."""
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(lambda run: (run, _run(*run)), RUNS))


@pytest.mark.slow
def test_the_readme_script_exits_zero_every_time(outcomes):
    failed = [
        f"{run}: rank {rank} exit {code}: {err}"
        for run, results in outcomes
        for rank, (code, err) in enumerate(results)
        if code != 0
    ]
    assert not failed, "\n".join(failed)


@pytest.mark.slow
def test_nothing_of_the_job_is_left_for_the_interpreters_teardown(outcomes):
    """After a README-style run the rendezvous store's server is gone before the interpreter's
    own teardown: every group destroyed, and nothing of the pipeline's (nor a module it imported,
    such as torch.distributed.fsdp) holding the store."""
    (run, results), *_ = outcomes
    assert run == (2, "zb-h1", "plain", True)
    assert [code for code, _ in results] == [0, 0], results
    assert "store server at exit: gone" in results[0][1], results[0][1]
