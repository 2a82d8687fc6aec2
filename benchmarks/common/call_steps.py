"""Running one device call's steps: each command under its own timeout, its output in its own log,
inside the call's wall budget (standard library only).

A device call returns only what it leaves under ``$OUT`` and stops at a fixed wall limit, so a
call's plan is a list of steps, each one bounded (``timeout -k``: a step that hangs is killed, and
the steps after it still run) and each leaving its log behind whatever happens to the others.
The plans themselves are data beside the benchmark they run (``incumbents_call_plans.py``,
``run_gpu_all.py``); this module only runs them."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


class Clock:
    """Seconds since the call began, as bash's ``$SECONDS`` counts them."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def seconds(self) -> int:
        return int(time.monotonic() - self.started)


def run_logged(
    argv: Sequence[str],
    limit_s: int,
    log: Path,
    env: Mapping[str, str] | None = None,
    kill_after_s: int = 10,
    append: bool = False,
) -> int:
    """Run ``argv`` under ``timeout -k kill_after_s limit_s``, stdout and stderr into ``log``;
    the exit status (124 when the timeout stopped it). ``timeout`` signals the whole command, a
    launcher's ranks included, which a Python-side timeout would not."""
    if limit_s < 1:
        raise ValueError(f"a step needs a timeout of at least 1 s, not {limit_s}")
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a" if append else "w") as out:
        done = subprocess.run(
            ["timeout", "-k", str(kill_after_s), str(limit_s), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(os.environ if env is None else env),
            check=False,
        )
    return done.returncode


def torchrun(python: str, nproc: int) -> list[str]:
    """The launcher's command line, through the interpreter that runs the call (the device
    machine's ``torchrun`` may belong to another Python)."""
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of a text file; none when it is missing."""
    try:
        return path.read_text(errors="replace").splitlines()[-lines:]
    except FileNotFoundError:
        return []
