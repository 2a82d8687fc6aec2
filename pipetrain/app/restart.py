"""Automatic restart: ``pipetrain train --max-restarts N`` runs its workers under torchrun's elastic
agent on this machine, and a worker that starts again resumes from the latest checkpoint.

The agent (``torch.distributed.elastic``'s ``LocalElasticAgent``, in this process: what
``torchrun --max-restarts N`` runs, c10d rendezvous on the loopback address) starts the workers
with torchrun's environment, so each one runs exactly as under a user's own torchrun
(``app.torchrun``). When one dies (a signal, the out-of-memory killer, an exception on one rank)
the agent kills every worker and starts them all again, up to N times; this module's agent says
which rank died, how, and when, and from which checkpoint the next attempt resumes. A refusal
(exit 2: the same on every attempt) and a stop on SIGTERM (``app.termination``) are not retried.
SIGTERM, SIGINT or SIGHUP to the launcher reach every worker as SIGTERM; what is left after
``--term-grace`` is killed. The exit statuses are the own launcher's (``app.launch``).

The rule a restarted worker follows (``resume_on_restart``) is torchtitan's: a checkpoint folder
that holds checkpoints is resumed from. It applies when the worker is a restart —
``TORCHELASTIC_RESTART_COUNT`` (torchrun's agent, this module's included) or
``SLURM_RESTART_COUNT`` (a requeued Slurm job) above 0 — so a first start keeps its checks (a
folder with a previous run's checkpoints needs ``--resume`` or ``--overwrite-checkpoints``). A
restart resumes from the checkpoint ``latest`` names, which is written only once a checkpoint is
complete (a checkpoint being written when the worker died is a ``.partial`` folder, ignored and
named, and replaced when that step is saved again). With ``--overwrite-checkpoints`` only a
checkpoint written since the agent started counts (the older ones are a previous run's).

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pipetrain.app.checkpoints import latest_pointer
from pipetrain.app.config import TrainConfig
from pipetrain.app.processes import signal_name
from pipetrain.app.termination import TERMINATED

#: the variables that say a worker is a restart: torchrun's agent's, and Slurm's on a requeue
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")
#: torch's switch that gives each attempt's workers a store of their own (see ``run_elastic``)
SHARE_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
#: how often the agent looks at its workers (s)
_MONITOR_S = 0.1
#: the exit statuses that are the same on any attempt: retrying them is pointless
_FINAL = {2: "refused", TERMINATED: "stopped on SIGTERM"}


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times this worker's job was started before (0: a first start)."""
    counts = [environ.get(name, "0") for name in RESTART_COUNTS]
    return max((int(c) for c in counts if c.strip().isdigit()), default=0)


def agreed_restart_count() -> int:
    """``restart_count`` of this environment, the largest over the job's processes (collective
    over the default group): every agent counts its own restarts, and one that restarts
    because another did (a membership change) does not count it, so the processes of one
    attempt may disagree; they must agree on whether to resume."""
    import torch
    import torch.distributed as dist

    count = torch.tensor([restart_count(os.environ)], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        count = count.cuda()
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    return int(count.item())


def resume_on_restart(config: TrainConfig, restarts: int) -> TrainConfig:
    """``config`` as a worker started for the ``restarts``-th time runs it: resuming from the
    latest checkpoint in ``--checkpoint-dir`` when there is one this job may resume (see the
    module docstring); ``config`` itself on a first start, without a folder, or with nothing to
    resume."""
    if config.checkpoint_dir is None or config.resume or restarts == 0:
        return config
    latest = latest_pointer(config.checkpoint_dir)
    if latest is None or not latest.is_dir():
        return config  # nothing saved yet: start over, as the first attempt did
    if config.overwrite_checkpoints:
        began = _agent_started()
        pointer = Path(config.checkpoint_dir) / "latest"
        if began is None or pointer.stat().st_mtime < began:
            return config  # a previous run's checkpoint: this job replaces those
    return dataclasses.replace(config, resume=True, overwrite_checkpoints=False)


def restart_note(config: TrainConfig, restarts: int) -> str:
    """The line a restarted job prints once (``config`` as ``resume_on_restart`` gave it; ""
    on a first start): where it continues from."""
    if restarts == 0:
        return ""
    if config.resume:
        return (
            f"restart {restarts}: continuing from the latest checkpoint in {config.checkpoint_dir}"
        )
    where = "no --checkpoint-dir" if config.checkpoint_dir is None else "no checkpoint of this job"
    return f"restart {restarts}: {where} to resume from; starting over from step 0"


def _agent_started() -> float | None:
    """When this process's parent (the agent that restarts it) started, in seconds since the
    epoch (Linux ``/proc``), or None where that cannot be read."""
    try:
        stat = Path(f"/proc/{os.getppid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def shared_store_warning(environ: Mapping[str, str]) -> str:
    """Why a restart of this torchrun job may fail to form its process group ("" where it
    will not): with ``--max-restarts`` and the agent's shared store, a restarted process group
    can read the previous attempt's addresses (torch issue 135712)."""
    restarts = environ.get("TORCHELASTIC_MAX_RESTARTS", "0")
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or restarts in ("", "0"):
        return ""
    return (
        f"torchrun --max-restarts {restarts} shares its store with the workers, and a restarted "
        "process group may read the last attempt's addresses and fail to connect (torch issue "
        f"135712); export {SHARE_STORE}=1 before torchrun"
    )


def check_restarts(config: TrainConfig, under_torchrun: bool) -> None:
    """``--max-restarts`` starts this command's own agent: under torchrun, torchrun's own
    ``--max-restarts`` restarts the job instead (``ValueError``)."""
    if under_torchrun and config.max_restarts:
        raise ValueError(
            "--max-restarts runs pipetrain's own elastic agent; under torchrun give "
            "torchrun --max-restarts N instead"
        )


def run_elastic(
    config: TrainConfig, processes: int, worker_argv: list[str], environment: Mapping[str, str]
) -> int:
    """Run ``processes`` workers of ``pipetrain train worker_argv`` under an elastic agent with
    ``config.max_restarts`` restarts, with ``environment``'s thread count and log level
    (``app.launch.worker_environment``, whose ``MASTER_PORT`` is taken for the rendezvous);
    the launcher's exit status (see the module docstring)."""
    import logging

    from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

    # the agent's own log lines say nothing this module's do not (torch gives each of its
    # modules' loggers a level and handler of its own)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    port = environment["MASTER_PORT"]
    env = {k: environment[k] for k in ("OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL")}
    env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGINT,SIGHUP"  # the agent's, as ours
    # a store of its own for each attempt, hosted by its rank 0: the agent's shared store keeps
    # the last attempt's keys, which a restarted process group reads (torch issue 135712)
    env[SHARE_STORE] = "1"
    saved = {k: os.environ.get(k) for k in env}
    # the agent starts its workers with this process's environment (as torchrun sets
    # OMP_NUM_THREADS in its own); put back once the run ends
    os.environ.update(env)
    params = RendezvousParameters(
        backend="c10d",
        endpoint=f"127.0.0.1:{port}",
        run_id=f"pipetrain-{uuid.uuid4().hex[:12]}",
        min_nodes=1,
        max_nodes=1,
    )
    handler = registry.get_rendezvous_handler(params)
    # the agent handles the stop signals while its workers run (a SignalException); they are
    # given back after, so that a late signal is not an exception with no one to catch it
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        with tempfile.TemporaryDirectory(prefix="pipetrain-elastic-") as logs:
            spec = WorkerSpec(
                role="pipetrain",
                local_world_size=processes,
                entrypoint=sys.executable,
                args=("-m", "pipetrain", "train", *worker_argv),
                rdzv_handler=handler,
                max_restarts=config.max_restarts,
                monitor_interval=_MONITOR_S,
            )
            agent = _agent_class()(
                config,
                spec=spec,
                logs_specs=DefaultLogsSpecs(log_dir=logs),
                shutdown_timeout=max(1, math.ceil(config.term_grace)),
            )
            try:
                result = agent.run()
            except SignalException as e:
                return _stopped(config, int(e.sigval), agent.last_codes)
    finally:
        handler.shutdown()
        for number, action in previous.items():
            signal.signal(number, action)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if result.state == WorkerState.SUCCEEDED:
        return 0
    return _failed(config, result.failures)


def _stopped(config: TrainConfig, number: int, codes: dict[int, int | None]) -> int:
    """The launcher's status after a stop signal: ``TERMINATED`` where the workers stopped on
    it with their checkpoint (rank 0 said so), else 128 + the signal, said."""
    if TERMINATED in codes.values():
        return TERMINATED
    print(
        f"pipetrain train: stopped by {signal_name(number)}; every worker stopped"
        f"{_latest(config, 'latest checkpoint')}",
        file=sys.stderr,
        flush=True,
    )
    return 128 + number


def _failed(config: TrainConfig, failures: Mapping[int, Any]) -> int:
    """The launcher's status once no restart is left (or none is worth it)."""
    rank, failure = _first(failures)
    code = failure.exitcode
    if code in _FINAL:  # the worker said why, and no restart was worth it
        return code
    print(
        f"pipetrain train: error: {_who(rank, failure)}; no restart left (--max-restarts "
        f"{config.max_restarts}){_latest(config, 'latest checkpoint')}",
        file=sys.stderr,
        flush=True,
    )
    return 1


def _first(failures: Mapping[int, Any]) -> tuple[int, Any]:
    """The failure that started it. When the agent finds several workers ended at once, a worker
    killed by a signal comes first: its peers fail after it (a connection reset, the pipeline's
    failure notice) and exit with a status; among equals, the earliest, then the first the agent
    recorded (it records the workers it found ended before the ones it then stopped)."""
    ranked = enumerate(failures.items())
    _, first = min(ranked, key=lambda f: (f[1][1].exitcode >= 0, f[1][1].timestamp, f[0]))
    return first


def _who(rank: int, failure: Any) -> str:
    code = failure.exitcode
    how = f"killed by {signal_name(-code)}" if code < 0 else f"exited with status {code}"
    when = time.strftime("%H:%M:%S", time.localtime(failure.timestamp))
    return f"rank {rank} (pid {failure.pid}) {how} at {when}"


def _latest(config: TrainConfig, what: str) -> str:
    if config.checkpoint_dir is None:
        return ""
    latest = latest_pointer(config.checkpoint_dir)
    return f"; {what}: {latest}" if latest is not None else "; no checkpoint written"


def _agent_class() -> type:
    """``LocalElasticAgent`` that names each failure and resumes (see the module docstring);
    defined on first use, so that torch is imported only when a run starts."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class RestartingAgent(LocalElasticAgent):
        def __init__(self, config: TrainConfig, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.config = config
            #: the workers' exit statuses once stopped by a signal (local rank → status)
            self.last_codes: dict[int, int | None] = {}
            self._failure: tuple[int, Any] | None = None

        def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
            result = super()._monitor_workers(worker_group)
            if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) and result.failures:
                self._failure = _first(result.failures)
                if self._failure[1].exitcode in _FINAL:
                    self._remaining_restarts = 0
            return result

        def _stop_workers(self, worker_group: WorkerGroup) -> None:
            # after a failure the survivors wait on the dead one: kill them at once
            # (checkpoints are renamed into place once complete, so none is half-visible)
            self._shutdown(signal.SIGKILL, timeout=self._shutdown_timeout)

        def _restart_workers(self, worker_group: WorkerGroup) -> None:
            self._stop_workers(worker_group)
            worker_group.state = WorkerState.STOPPED
            count = self.config.max_restarts - self._remaining_restarts
            who = _who(*self._failure) if self._failure else "a worker failed"
            print(
                f"pipetrain train: {who}; restarting every worker (restart {count} of "
                f"{self.config.max_restarts}){_latest(self.config, 'resuming from')}",
                file=sys.stderr,
                flush=True,
            )
            self._initialize_workers(worker_group)

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            super()._shutdown(death_sig, timeout)
            if self._pcontext is not None:
                handlers = getattr(self._pcontext, "subprocess_handlers", {})
                self.last_codes = {r: h.proc.returncode for r, h in handlers.items()}

    return RestartingAgent


__all__ = [
    "RESTART_COUNTS",
    "SHARE_STORE",
    "agreed_restart_count",
    "check_restarts",
    "restart_count",
    "restart_note",
    "resume_on_restart",
    "run_elastic",
    "shared_store_warning",
]
