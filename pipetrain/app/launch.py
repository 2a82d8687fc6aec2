"""``pipetrain train``: train a model cut into pipeline stages on a text file, then compare the
measured step with the simulator's. This module is the command's entry point and starts its
processes.

One command for every model ``app.catalog`` builds — the built-in GPT and the Hugging
Face Llama family (``--model llama|qwen3|mistral``, from a ``transformers`` config: tiny by
default, nothing downloaded) — as a list of layers cut into stages by per-stage layer counts
(``app.config``: the default cut, or a plan's from ``--plan FILE``).

Run outside a launcher, ``run_train`` checks the ``TrainConfig`` (exit 2 on bad input, before
any process starts) and starts ``--ranks`` × ``--dp`` worker processes with the environment
torchrun sets — gloo on CPU, NCCL with a GPU per process — each running this same command with
the flags that reproduce the config (``TrainConfig.argv``). A worker sets up its device and the
process group, runs the training loop (``app.train``) and, on rank 0, prints the report
(``app.report``). ``app.processes`` supervises them: a stop signal to the launcher stops them all
(exit 128 + the signal), a worker killed by a signal is named. A worker that fails writes its
traceback to its log and the launcher prints the cause in one line (``app.failure_logs``). Exit
status: 0; 2 for bad input or a configuration the pipeline refuses (the library's message, no
traceback); 1 when the run stopped (a loss that is not finite, a worker killed, a worker
failed); 75 (``app.termination.TERMINATED``) when SIGTERM stopped every rank after the same step
and its checkpoint was written (``--checkpoint-on-term``); 128 + the signal when a stop signal
ended it otherwise. With ``--max-restarts N`` the workers run under torchrun's elastic agent
instead, which restarts them all when one dies (``app.restart``), with the same statuses.
How many processes a run has, and along which dimensions, is ``process_grid``'s alone. Started
by torchrun (on one machine or several), every process is a worker instead and global rank 0
checks the job for all (``app.torchrun``), through this module's ``join_group`` and ``work``.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, NoReturn

from pipetrain.app import failure_logs
from pipetrain.app.checkpoints import incomplete_checkpoints, latest_complete, latest_pointer
from pipetrain.app.config import Device, TrainConfig
from pipetrain.app.processes import (
    LAUNCHER_PID,
    Ended,
    signal_name,
    start_processes,
    watch_launcher,
)
from pipetrain.app.restart import restart_count, restart_note, resume_on_restart, run_elastic
from pipetrain.app.termination import TERMINATED, Terminated, check_termination
from pipetrain.app.train import NonFinite, Refused, train
from pipetrain.app.train_checks import check_arguments
from pipetrain.planner.layout import Layout
from pipetrain.schedule.program import describe_shape

if TYPE_CHECKING:
    import torch


def run_train(config: TrainConfig) -> int:
    """Launch the workers, or be one (``--worker``: started by this command's own launcher);
    return the exit status. Under torchrun, ``app.torchrun.run_under_torchrun`` runs instead."""
    if config.worker:
        watch_launcher()  # first: a launcher gone while this one starts up is noticed
    quiet_import_notices()  # before the checks, which import transformers for --model-dir
    restarts = 0 if config.worker else restart_count(os.environ)  # a requeued job's count
    if restarts:  # it resumes (app.restart); its workers are given --resume
        config = resume_on_restart(config, restarts)
        print(f"pipetrain train: {restart_note(config, restarts)}", flush=True)
    try:
        check_termination(config)
        layout = check_arguments(config)
    except ValueError as e:
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    if config.worker:
        return _worker(config, layout)
    return _launch(config, layout)


def _resolve_device(config: TrainConfig, layout: Layout) -> Device:
    """``--device`` for the whole job on this machine, checked against the layout."""
    device = device_for(config, processes_of(config, layout))
    check_offload(device, layout)
    return device


def device_for(config: TrainConfig, need: int) -> Device:
    """``--device`` resolved for ``need`` processes on this machine, a GPU each."""
    import torch

    gpus = torch.cuda.device_count()
    if config.device == "cuda" and gpus < need:
        raise ValueError(f"--device cuda needs {need} GPUs (one per process); found {gpus}")
    return ("cuda" if gpus >= need else "cpu") if config.device == "auto" else config.device


def check_offload(device: str, layout: Layout) -> None:
    """A plan that offloads activations to host memory runs on GPUs only."""
    if device == "cpu" and layout.offloads:
        raise ValueError(
            f"the plan offloads activations to host memory (offload {list(layout.offload)}), "
            "which saves nothing on a CPU run, where the host is the device; run on GPUs "
            "(--device cuda) or plan without offload (a costs file without host_bandwidth_gbs)"
        )


def process_grid(config: TrainConfig, layout: Layout) -> dict[str, int]:
    """The run's processes as named dimensions (their product is the process count), outermost
    first as the processes are numbered (pp-major, tp innermost: ``app.train``'s mesh); the one
    place that says how many processes a run has."""
    return {"pipeline": layout.ranks, "data parallel": config.dp, "tensor parallel": config.tp}


def processes_of(config: TrainConfig, layout: Layout) -> int:
    """The job's processes: pipeline ranks × tensor-parallel size × data-parallel replicas."""
    return math.prod(process_grid(config, layout).values())


def _launch(config: TrainConfig, layout: Layout) -> int:
    try:
        device = _resolve_device(config, layout)
    except ValueError as e:
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    processes = processes_of(config, layout)
    # every worker parses this back into the same config, the device resolved once here
    worker_argv = dataclasses.replace(config, device=device, max_restarts=0).argv()
    failure_logs.clear_logs(failure_logs.log_folder(config))
    if config.max_restarts:
        announce(f"launching (up to {config.max_restarts} restarts)", config, layout, device)
        return run_elastic(config, processes, worker_argv, worker_environment(processes))
    announce("launching", config, layout, device)
    cmd = [sys.executable, "-m", "pipetrain", "train", *worker_argv, "--worker"]
    with hosted_store(processes) as port:
        env = worker_environment(processes, port) | {"TORCHELASTIC_USE_AGENT_STORE": "True"}
        ended = start_processes(processes, cmd, env, config.term_grace)
    status, message = _outcome(ended, config)
    if message:
        lead = "\n" if sys.stderr.isatty() else ""  # after a progress line still being drawn
        print(f"{lead}pipetrain train: {message}", file=sys.stderr)
    return status


def announce(verb: str, config: TrainConfig, layout: Layout, device: Device) -> None:
    """The launch line (``verb`` N processes: their grid, backend, model and layout) and the
    incomplete checkpoints the run ignores."""
    grid = process_grid(config, layout)
    backend = "NCCL" if device == "cuda" else "gloo"
    model = config.model if config.model_dir is None else f"--model-dir {config.model_dir}"
    shape = " × ".join(f"{n} {name}" for name, n in grid.items())
    print(
        f"{verb} {math.prod(grid.values())} processes: {shape} ({backend} on {device}); "
        f"{model}, {_describe(layout, config.plan, config.global_batch_tokens)}"
    )
    for path in incomplete_checkpoints(config):
        print(f"note: ignoring {path}: an incomplete checkpoint (a run stopped while writing it)")
    sys.stdout.flush()


@contextmanager
def hosted_store(count: int) -> Iterator[int]:
    """The workers' rendezvous store, hosted by the launcher (as torchrun's agent hosts it) on
    a port the operating system gives it and held until the workers end; its port. Choosing a
    free port for rank 0 to bind later would race: between the choice and the bind, another
    process (or an outgoing connection) can be given the same port."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, count, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def worker_environment(count: int, port: int | None = None) -> dict[str, str]:
    """The environment torchrun sets, less the per-rank variables (``start_processes`` adds
    them): one local process group of ``count`` processes rendezvousing at ``port`` (default: a
    free one, which whoever binds it first takes)."""
    import socket

    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    # one thread per process: they share the cores; torch's C++ warnings stay out of the
    # output (a peer's closed store connection, once one worker has failed, is a warning per
    # rank that says nothing the launcher's one line does not)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env | {
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(count),
        "LOCAL_WORLD_SIZE": str(count),
    }


def _outcome(ended: Ended, config: TrainConfig) -> tuple[int, str]:
    """The launcher's exit status and the line it prints (none where a worker said it)."""
    if ended.status == TERMINATED or (ended.signalled and TERMINATED in ended.codes):
        return TERMINATED, ""  # stopped together on SIGTERM, the checkpoint written: rank 0 said
    if ended.signalled:
        name = signal_name(ended.signalled)
        return 128 + ended.signalled, f"stopped by {name}; every worker stopped{_kept(config)}"
    if ended.status == 0:
        return 0, ""
    if ended.status == REFUSED:
        return 2, ""  # the worker printed the pipeline's refusal
    if ended.status == STOPPED:
        return 1, ""  # the worker printed why it stopped
    who = f"rank {ended.rank} (pid {ended.pid})"
    if ended.status < 0:
        name = signal_name(-ended.status)
        why = (
            " (the kernel's out-of-memory killer sends it, among others)"
            if name == "SIGKILL"
            else ""
        )
        return (
            1,
            f"error: {who} killed by {name}{why}; the other workers were stopped{_kept(config)}",
        )
    logs = failure_logs.log_folder(config)
    found = failure_logs.read_cause(logs)
    if found is None:  # no worker could write its log: it printed its traceback
        return ended.status, (
            f"error: {who} exited with status {ended.status} (its error is above); the other "
            f"workers were stopped{_kept(config)}"
        )
    rank, cause = found
    return ended.status, f"error: rank {rank} failed: {cause}{_good(config)}; logs: {logs}/"


def _kept(config: TrainConfig) -> str:
    """Where the run can resume from, if it wrote a checkpoint."""
    if config.checkpoint_dir is None:
        return ""
    latest = latest_pointer(config.checkpoint_dir)  # a file read: no time lost stopping
    return f"; latest checkpoint: {latest}" if latest is not None else ""


def _good(config: TrainConfig) -> str:
    """The latest checkpoint whose files are all there, to resume from after a failure."""
    if config.checkpoint_dir is None:
        return ""
    good = latest_complete(config.checkpoint_dir)
    return f"; latest good checkpoint: {good}" if good is not None else "; no checkpoint written"


def _describe(layout: Layout, plan_file: str | None, budget: int | None = None) -> str:
    cut = f"stage_layers {list(layout.stage_layers)}"
    if budget is not None:  # each step's count comes from its documents; this one is nominal
        cut = f"a budget of {budget} tokens per step (the count above nominal), {cut}"
    if layout.recomputes:
        cut += f", recompute {list(layout.recompute)}"
    if layout.offloads:
        cut += f", offload {list(layout.offload)}"
    source = f" (plan {plan_file})" if plan_file else ""
    return (
        describe_shape(layout.schedule, layout.ranks, layout.stages_per_rank, layout.microbatches)
        + f", {cut}{source}"
    )


#: a worker's exit status when the library refused the configuration (the launcher exits 2)
REFUSED = 3
#: a worker's exit status when the run stopped for a reason rank 0 printed (the launcher exits 1)
STOPPED = 4


def quiet_import_notices() -> None:
    """Keep notices that say nothing about the run out of a worker's output. ``transformers``
    imports torchao where it is installed (its quantizer registry): torchao warns for each
    prebuilt CUDA extension it cannot load on this machine, and torch warns that torchao's pytree
    registrations are deprecated. ``--float8`` checks torchao itself and fails loudly."""
    import logging

    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _worker(config: TrainConfig, layout: Layout) -> int:
    return work(config, join_group(config, _resolve_device(config, layout)))


def join_group(config: TrainConfig, device_kind: Device) -> torch.device:
    """Set up this worker's device (``LOCAL_RANK``'s GPU, or the CPU with one thread) and join
    the job's default process group (NCCL on GPUs, gloo on the CPU) from torchrun's
    environment; return the device."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if config.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting then
        from pipetrain.runtime.deterministic import use_deterministic_algorithms

        use_deterministic_algorithms()
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout))
    return device


def work(config: TrainConfig, device: torch.device, *, final: bool = False) -> int:
    """One worker's run inside the joined process group: train, print the report (rank 0) or
    the reason it stopped, leave the group; return the worker's exit status: for the own
    launcher (``REFUSED``, ``STOPPED``), or with ``final`` the command's own (2, 1), for a
    worker whose status no launcher of ours reads (torchrun's)."""
    import torch.distributed as dist

    try:
        from pipetrain.runtime.comm.barrier import barrier
        from pipetrain.runtime.comm.failures import PipelineRefused

        try:
            run = train(config, device)
            status, said, stream = 0, run.report, sys.stdout
        except (Refused, PipelineRefused) as e:  # the same on every rank, once they hear of it
            _tell_peers(config, e)  # a refusal of this rank's alone (before its pipeline)
            status, said, stream = REFUSED, f"pipetrain train: error: {e}", sys.stderr
        except NonFinite as e:  # the same on every rank: every rank has the same loss
            status, said, stream = STOPPED, f"pipetrain train: error: {e}", sys.stderr
        except Terminated as e:  # every rank stopped after the same step (app.termination)
            status, said, stream = TERMINATED, f"pipetrain train: {e}", sys.stderr
        except BaseException as e:  # torch.distributed.checkpoint's failures are BaseExceptions
            if isinstance(e, (SystemExit, KeyboardInterrupt)):
                raise
            _failed(config, e)
        if final:
            status = {REFUSED: 2, STOPPED: 1}.get(status, status)
        if status != 0 and device.type == "cuda":
            _leave_without_teardown(status, said, stream)
        if dist.get_rank() == 0:
            print(said, file=stream, flush=True)
        # Tear down together, also after a refusal: a gloo group destroyed while a peer is
        # still busy (rank 0 writing the report) can abort the process at exit.
        barrier()
        return status
    finally:
        dist.destroy_process_group()


def _failed(config: TrainConfig, error: BaseException) -> NoReturn:
    """End a worker that failed: its traceback to its log (``app.failure_logs``; printed where
    the log cannot be written), the peers told (they may be waiting to build their pipeline
    with this one), then exit at once with status 1. Leaving without teardown closes this
    process's connections, so a peer blocked on it fails now; the launcher stops the rest."""
    import torch.distributed as dist

    rank = dist.get_rank()
    logged = failure_logs.write_log(failure_logs.log_folder(config), rank, error)
    # torchrun's agent reads no log (no LAUNCHER_PID: not the own launcher's): show the traceback
    if not logged or LAUNCHER_PID not in os.environ:
        import traceback

        traceback.print_exception(error)
    _tell_peers(config, error)
    _leave_without_teardown(1, "", sys.stderr)


def _tell_peers(config: TrainConfig, error: BaseException) -> None:
    """Tell the peers building their pipeline that this rank failed before building its own
    (``runtime.comm.agreement.fail_next_pipeline``), on the default group: the pipeline's own
    where there is no mesh (``--dp`` and ``--tp`` 1)."""
    if config.dp == 1 and config.tp == 1:
        from pipetrain.runtime.comm.agreement import fail_next_pipeline

        fail_next_pipeline(error)


def _leave_without_teardown(status: int, said: str, stream) -> NoReturn:
    """End a worker that stopped on NCCL (or failed, on any backend), now, without meeting its
    peers or destroying its groups: a peer may be blocked on the device for good (waiting for a
    transfer this rank will never send — inside a replayed CUDA graph, or behind its launch
    queue), and both the barrier and the communicators' destruction would wait for it. The launcher (``app.processes``) stops
    the others once this process has exited. ``said`` (refusals, the same on every rank) is
    printed by rank 0; another rank prints it only if rank 0 has not within ``_SAID_WAIT_S``
    (rank 0 may be the blocked one)."""
    from datetime import timedelta

    import torch.distributed as dist

    from pipetrain.runtime.torch_compat import store_of

    if said:
        store, key, heard = store_of(None), "pipetrain/app/said", "pipetrain/app/heard"
        if dist.get_rank() == 0:
            print(said, file=stream, flush=True)
            store.set(key, "1")
            # rank 0 holds the store: stay until the others have read the key (or not come)
            deadline = time.monotonic() + _SAID_WAIT_S
            while store.add(heard, 0) < dist.get_world_size() - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        else:
            try:
                store.wait([key], timedelta(seconds=_SAID_WAIT_S))
                store.add(heard, 1)
            except Exception:  # rank 0 did not say it (blocked, or gone with its store)
                print(said, file=stream, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


#: how long a rank that stopped waits for rank 0 to print the reason before printing it itself
_SAID_WAIT_S = 10


__all__ = [
    "REFUSED",
    "STOPPED",
    "announce",
    "check_offload",
    "device_for",
    "hosted_store",
    "join_group",
    "process_grid",
    "processes_of",
    "run_train",
    "work",
    "worker_environment",
]
