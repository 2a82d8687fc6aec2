"""``pipetrain train`` started by torchrun (``torch.distributed.run``), on one machine or several:
every process torchrun starts is a worker, with no flag of its own.

The own launcher (``app.launch``) checks the flags once before any process starts; under
torchrun there is no such moment, so global rank 0 does it for the job: after every process has
joined the default process group, rank 0 alone runs the launcher's checks (the flags, the
``--model-dir`` data tokenized into the data cache, the checkpoint folder's lock probe), checks
that torchrun started ``--ranks`` × ``--tp`` × ``--dp`` processes and prints the launch line,
then writes the outcome — ok, or the error's one line — under one key of the default group's
store. The others wait on that key, so they read the data cache and the checkpoint folder only
after rank 0 has written them, and a refusal ends every process with exit status 2 and the same
line (printed once per machine, by its local rank 0), before any pipeline is built.

Processes are numbered pp-major with tp innermost (``app.train``'s mesh, as torchtitan and
Megatron-Core order theirs): torchrun gives each machine consecutive ranks, so a stage's
tensor-parallel group lies inside a machine where ``--tp`` divides ``--nproc-per-node`` (rank 0
warns where it does not), and pipeline neighbours cross machines. A pipeline refusal or a stop
exits 2 or 1 as under the own launcher; torchrun then stops the other processes and reports.

Under ``torchrun --max-restarts N`` a restarted process (``TORCHELASTIC_RESTART_COUNT`` > 0)
resumes from the latest checkpoint in ``--checkpoint-dir`` (``app.restart``), and with
``--checkpoint-on-term`` SIGTERM stops every process after the same step with a checkpoint
(``app.termination``): the same worker as ``pipetrain train --max-restarts N`` starts.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from datetime import timedelta

from pipetrain.app import failure_logs
from pipetrain.app.config import Device, TrainConfig
from pipetrain.app.launch import (
    announce,
    check_offload,
    device_for,
    join_group,
    processes_of,
    quiet_import_notices,
    work,
)
from pipetrain.app.processes import LAUNCHER_PID, die_with_parent
from pipetrain.app.restart import (
    agreed_restart_count,
    check_restarts,
    restart_note,
    resume_on_restart,
    shared_store_warning,
)
from pipetrain.app.termination import check_termination
from pipetrain.app.train_checks import check_arguments

#: the store key under which rank 0 writes the checks' outcome
_CHECKED = "pipetrain/torchrun/checked"
#: the store counter the processes add to once they have printed a refusal
_TOLD = "pipetrain/torchrun/told"
#: how long the others wait for rank 0's checks (tokenizing a large ``--data`` takes long; a
#: rank 0 that died is noticed sooner: torchrun stops the job)
_CHECKS_WAIT_S = 3600.0
#: how long a refusing process waits for the others to have printed it before it exits
_TOLD_WAIT_S = 10.0


def under_torchrun(config: TrainConfig) -> bool:
    """Whether torchrun (``torch.distributed.run``) started this process as one of the job's:
    its agent sets ``TORCHELASTIC_RUN_ID`` in every worker's environment. A worker of this
    command's own launcher (``--worker``, ``LAUNCHER_PID``) is not one, even where that launcher
    ran under torchrun."""
    own = config.worker or LAUNCHER_PID in os.environ
    return "TORCHELASTIC_RUN_ID" in os.environ and not own


def run_under_torchrun(config: TrainConfig) -> int:
    """This process's run as one of torchrun's workers; its exit status (2: refused, 1:
    stopped or failed, 0: trained)."""
    quiet_import_notices()  # before the checks, which import transformers for --model-dir
    die_with_parent()  # an agent gone (SIGKILL included) leaves no worker training on
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    try:
        device_kind = device_for(config, local)
    except ValueError as e:  # the same on every process of this machine
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    device = join_group(config, device_kind)
    restarts = agreed_restart_count()
    given = config
    config = resume_on_restart(config, restarts)  # a restart resumes
    if restarts and not given.resume and int(os.environ.get("RANK", "0")) == 0:
        print(f"pipetrain train: {restart_note(config, restarts)}", flush=True)
    error = _checked_once(config, device_kind, world, local)
    if error:
        _refuse_together(error, world)
        # at once, every process together: torchrun stops the others when the first one exits
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)
    return work(dataclasses.replace(config, worker=True, device=device_kind), device, final=True)


def _checked_once(config: TrainConfig, device_kind: Device, world: int, local: int) -> str:
    """Rank 0's checks of the job (see the module docstring), their outcome shared with every
    rank: "" when they passed, else the error's line."""
    import torch.distributed as dist

    from pipetrain.runtime.torch_compat import store_of

    store = store_of(None)
    if dist.get_rank() == 0:
        error = ""
        try:
            check_restarts(config, under_torchrun=True)
            check_termination(config)
            layout = check_arguments(config)
            check_offload(device_kind, layout)
            check_world_size(config, processes_of(config, layout), world)
            failure_logs.clear_logs(failure_logs.log_folder(config))
            spans = tensor_parallel_warning(config.tp, local, world)
            for warning in (spans, shared_store_warning(os.environ)):
                if warning:
                    print(f"pipetrain train: warning: {warning}", file=sys.stderr, flush=True)
            announce("torchrun started", config, layout, device_kind)
        except ValueError as e:
            error = str(e) or type(e).__name__
        store.set(_CHECKED, "ok" if not error else f"error:{error}")
        return error
    store.wait([_CHECKED], timedelta(seconds=_CHECKS_WAIT_S))
    outcome = store.get(_CHECKED).decode()
    return "" if outcome == "ok" else outcome.removeprefix("error:")


def check_world_size(config: TrainConfig, need: int, world: int) -> None:
    """torchrun started as many processes as the flags give (``ValueError`` otherwise)."""
    if world != need:
        raise ValueError(
            f"torchrun started {world} processes (--nnodes × --nproc-per-node), but --ranks "
            f"{need // (config.tp * config.dp)} × --tp {config.tp} × --dp {config.dp} needs "
            f"{need}: start {need} processes or change the flags"
        )


def tensor_parallel_warning(tp: int, local: int, world: int) -> str:
    """Why a tensor-parallel group would span machines ("" where none does): ranks are
    pp-major with tp innermost, and each machine holds ``local`` consecutive ranks."""
    if tp == 1 or world == local or local % tp == 0:
        return ""
    return (
        f"--tp {tp} does not divide the {local} processes per machine (--nproc-per-node): some "
        "stage's tensor-parallel group spans machines, and its every layer's collectives cross "
        "the network; give --nproc-per-node a multiple of --tp"
    )


def _refuse_together(error: str, world: int) -> None:
    """Print the refusal (once per machine) and wait until every process has, so torchrun
    stops none of them before it said why."""
    from pipetrain.runtime.torch_compat import store_of

    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print(f"pipetrain train: error: {error}", file=sys.stderr, flush=True)
    store = store_of(None)
    deadline = time.monotonic() + _TOLD_WAIT_S
    try:
        store.add(_TOLD, 1)
        while store.add(_TOLD, 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # the store's host left: the others have read the outcome
        pass


__all__ = ["check_world_size", "run_under_torchrun", "tensor_parallel_warning", "under_torchrun"]
