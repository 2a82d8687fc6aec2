"""A run that is killed and stopped on purpose finishes with the uninterrupted run's weights.

The CI-sized case: ``pipetrain train --checkpoint-on-term`` (2 processes, 30 steps) gets
SIGTERM (as Slurm sends it) and exits 75 after a checkpoint; the job requeued
(``SLURM_RESTART_COUNT=1``, the same flags and ``--max-restarts 1``: the elastic agent) resumes,
has a worker killed by SIGKILL, restarts from its latest checkpoint and finishes. The stress case (``make test-all``): two torchrun agents of 2
processes each, 200 steps, a checkpoint every 10, three kills at steps drawn from a printed
seed, one SIGTERM to both agents, then the requeued job. Each ends with the uninterrupted
run's losses and final weights bit for bit, no process left, no ``.partial`` folder, and every
checkpoint verifying and loading."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

from runtime_harness import free_port  # noqa: E402

from pipetrain.cli.verify_command import problems_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt", "--layers", "4", "--hidden", "16", "--heads", "2", "--seq-len", "16"]
TINY += ["-m", "2", "--microbatch-size", "2", "--timeout", "60"]
TERMINATED = 75
BOUND_S = 120.0  # any one process's run on a loaded 2-core machine


def _env(**extra: str) -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    drop += ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | extra


class Job:
    """One command in the background, its output collected, its descendants tracked."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.seen: set[int] = set()
        assert self.proc.stdout is not None
        threading.Thread(target=self.lines.extend, args=(self.proc.stdout,), daemon=True).start()

    def workers(self) -> list[int]:
        """The worker processes now (the children running ``pipetrain train``), remembered."""
        found = [p for p in _children(self.proc.pid) if b"pipetrain" in _cmdline(p)]
        self.seen.update(found)
        return found

    def finish(self) -> int:
        """Wait for the command (its workers noted meanwhile); its exit status."""
        deadline = time.monotonic() + BOUND_S
        try:
            while self.proc.poll() is None and time.monotonic() < deadline:
                self.workers()
                time.sleep(0.05)
            return self.proc.wait(timeout=1)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            time.sleep(0.2)  # the reader takes the last lines

    def output(self) -> str:
        return "".join(self.lines)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pids: set[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def _steps_done(metrics: Path) -> int:
    try:
        return len(metrics.read_text().splitlines())
    except OSError:
        return 0


def _wait_for_step(job: Job, metrics: Path, step: int) -> None:
    deadline = time.monotonic() + BOUND_S
    while _steps_done(metrics) < step:
        assert job.proc.poll() is None, job.output()
        assert time.monotonic() < deadline, f"no step {step} within the bound\n{job.output()}"
        job.workers()
        time.sleep(0.02)


def _wait_for_output(job: Job, text: str, times: int) -> None:
    """Until ``job`` has said ``text`` ``times`` times (global rank 0 says it)."""
    deadline = time.monotonic() + BOUND_S
    while job.output().count(text) < times:
        assert job.proc.poll() is None, job.output()
        assert time.monotonic() < deadline, f"{text!r} not said\n{job.output()}"
        job.workers()
        time.sleep(0.02)


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def _state(checkpoint: Path) -> dict[str, object]:
    """A checkpoint's every tensor and value, by flattened name (loaded as DCP reads it)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(checkpoint, Path(d) / "state.pt")
        loaded = torch.load(Path(d) / "state.pt", weights_only=False)
    flat: dict[str, object] = {}

    def walk(value: object, name: str) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{name}/{k}")
        else:
            flat[name] = value

    walk(loaded, "")
    return flat


def _same(a: dict[str, object], b: dict[str, object]) -> list[str]:
    """The names whose values differ (tensors compared bit for bit)."""
    assert a.keys() == b.keys()
    differ = []
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and torch.equal(x, y)):
                differ.append(k)
        elif x != y:
            differ.append(k)
    return differ


def _check_folder(folder: Path, reference: Path, steps: int) -> None:
    """No temporary folder left; every checkpoint verifies and loads; the last one and the
    uninterrupted run's hold the same values."""
    leftovers = [p.name for p in folder.iterdir() if p.name.endswith(".partial")]
    assert leftovers == [], leftovers
    checkpoints = sorted(folder.glob("step-*"))
    assert checkpoints, list(folder.iterdir())
    for checkpoint in checkpoints:
        assert problems_of(checkpoint) == [], checkpoint
        _state(checkpoint)
    final = folder / f"step-{steps:06d}"
    assert _same(_state(final), _state(reference / f"step-{steps:06d}")) == []


def _train(name: str, tmp: Path, steps: int, every: int, *flags: str) -> list[str]:
    return [
        *TINY,
        "--steps",
        str(steps),
        "--checkpoint-dir",
        str(tmp / name),
        "--checkpoint-every",
        str(every),
        "--metrics",
        str(tmp / f"{name}.jsonl"),
        "--svg",
        str(tmp / f"{name}.svg"),
        "--corpus-out",
        str(tmp / "corpus.txt"),
        *flags,
    ]


def test_a_terminated_then_killed_run_finishes_as_the_uninterrupted_one(tmp_path: Path) -> None:
    """SIGTERM to the own launcher (forwarded to its workers), then the requeued job under the
    elastic agent (``--max-restarts 1``) with a worker killed: both launch paths, one run."""
    own = [sys.executable, "-m", "pipetrain", "train"]
    flags = _train("run", tmp_path, 30, 5, "--checkpoint-on-term")
    reference = Job([*own, *_train("ref", tmp_path, 30, 5)], _env())
    run = Job([*own, *flags], _env())
    metrics = tmp_path / "run.jsonl"

    _wait_for_step(run, metrics, 7)
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)  # as Slurm sends it
    status = run.finish()
    took, said = time.monotonic() - sent, run.output()
    assert status == TERMINATED, said
    assert took < 30, took  # --term-grace's default; a tiny step takes far less
    assert said.count("stopped by SIGTERM after step") == 1, said  # rank 0 says it
    assert _alive(run.seen) == [], _alive(run.seen)
    stopped_at = int(said.split("stopped by SIGTERM after step ")[1].split()[0])
    assert (tmp_path / "run" / f"step-{stopped_at:06d}").is_dir()

    # requeued: the same flags and restarts, Slurm's restart count set, no --resume given
    requeued = Job([*own, *flags, "--max-restarts", "1"], _env(SLURM_RESTART_COUNT="1"))
    _wait_for_output(requeued, "resuming from ", 1)
    assert f"resuming from {tmp_path / 'run'}/step-{stopped_at:06d}" in requeued.output()
    _wait_for_step(requeued, metrics, stopped_at + 4)
    victim = max(requeued.workers())
    os.kill(victim, signal.SIGKILL)
    assert requeued.finish() == 0, requeued.output()
    said = requeued.output()
    assert f"(pid {victim}) killed by SIGKILL" in said, said
    assert "restarting every worker (restart 1 of 1)" in said, said
    assert said.count("resuming from ") >= 2, said  # the restart resumed too
    assert reference.finish() == 0, reference.output()
    assert _alive(requeued.seen | reference.seen) == []
    assert _losses(metrics) == _losses(tmp_path / "ref.jsonl")
    _check_folder(tmp_path / "run", tmp_path / "ref", 30)


def _agents(flags: list[str], env: dict[str, str]) -> list[Job]:
    """Two torchrun agents on the loopback address, 2 processes each, up to 5 restarts."""
    port = str(free_port())
    jobs = []
    for _ in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        cmd += ["--nproc-per-node", "2", "--max-restarts", "5", "--rdzv-backend", "c10d"]
        cmd += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "soak"]
        cmd += ["--shutdown-timeout", "30", "--monitor-interval", "0.1"]
        cmd += ["-m", "pipetrain", "train", *flags]
        jobs.append(Job(cmd, env | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}))
        time.sleep(0.5)  # the first hosts the rendezvous
    return jobs


@pytest.mark.stress
def test_two_agents_killed_three_times_and_terminated_finish_as_the_uninterrupted_run(
    tmp_path: Path,
) -> None:
    seed = random.randrange(2**32)
    print(f"soak seed {seed}")  # pytest -s shows it; a failure shows it in the assertion too
    kills = sorted(random.Random(seed).sample(range(15, 160), 3))
    term_at = 175
    own = [sys.executable, "-m", "pipetrain", "train"]
    reference = Job([*own, *_train("ref", tmp_path, 200, 10, "--ranks", "4")], _env())
    flags = _train("run", tmp_path, 200, 10, "--ranks", "4", "--checkpoint-on-term")
    agents = _agents(flags, _env())
    metrics = tmp_path / "run.jsonl"
    for at in kills:
        _wait_for_step(agents[0], metrics, at)
        workers = [w for job in agents for w in job.workers()]
        victim = random.Random(seed + at).choice(workers)
        resumed = agents[0].output().count("resuming from ")
        os.kill(victim, signal.SIGKILL)
        _wait_for_output(agents[0], "resuming from ", resumed + 1)
    _wait_for_step(agents[0], metrics, term_at)
    for job in agents:
        job.proc.send_signal(signal.SIGTERM)
    for job in agents:
        job.finish()
    said = agents[0].output() + agents[1].output()
    assert "stopped by SIGTERM after step" in said, (seed, said)
    assert _alive(set().union(*(job.seen for job in agents))) == [], seed

    requeued = _agents(flags, _env(SLURM_RESTART_COUNT="1"))
    assert [job.finish() for job in requeued] == [0, 0], (seed, requeued[0].output())
    assert reference.finish() == 0, reference.output()
    assert _alive(set().union(*(job.seen for job in requeued))) == [], seed
    assert _losses(metrics) == _losses(tmp_path / "ref.jsonl"), seed
    _check_folder(tmp_path / "run", tmp_path / "ref", 200)
