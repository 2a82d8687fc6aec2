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
(``app.report``). A configuration the pipeline refuses makes the launcher exit 2 too, with the
library's message and no traceback.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

from pipetrain.app.config import Device, TrainConfig, check_arguments
from pipetrain.app.train import Refused, train
from pipetrain.planner.layout import Layout
from pipetrain.schedule.program import describe_shape


def run_train(config: TrainConfig) -> int:
    """Launch the workers (outside torchrun) or be one (inside); return the exit status."""
    try:
        layout = check_arguments(config)
    except ValueError as e:
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    if config.worker:
        return _worker(config, layout)
    return _launch(config, layout)


def _resolve_device(config: TrainConfig, layout: Layout) -> Device:
    import torch

    need, gpus = processes_of(config, layout), torch.cuda.device_count()
    if config.device == "cuda" and gpus < need:
        raise ValueError(f"--device cuda needs {need} GPUs (one per process); found {gpus}")
    if config.device == "auto":
        return "cuda" if gpus >= need else "cpu"
    return config.device


def processes_of(config: TrainConfig, layout: Layout) -> int:
    """The job's processes: pipeline ranks × tensor-parallel size × data-parallel replicas."""
    return layout.ranks * config.tp * config.dp


def _launch(config: TrainConfig, layout: Layout) -> int:
    try:
        device = _resolve_device(config, layout)
    except ValueError as e:
        print(f"pipetrain train: error: {e}", file=sys.stderr)
        return 2
    processes = processes_of(config, layout)
    # every worker parses this back into the same config, the device resolved once here
    worker_argv = dataclasses.replace(config, device=device).argv()
    backend = "NCCL" if device == "cuda" else "gloo"
    print(
        f"launching {processes} processes: {layout.ranks} pipeline × {config.tp} tensor parallel "
        f"× {config.dp} data parallel "
        f"({backend} on {device}); {config.model}, {_describe(layout, config.plan)}"
    )
    sys.stdout.flush()
    status = start_processes(processes, [sys.executable, "-m", "pipetrain", "train", *worker_argv])
    return 2 if status == _REFUSED else status


def start_processes(count: int, cmd: list[str]) -> int:
    """Run ``cmd --worker`` as ``count`` processes of one local process group (the environment
    torchrun sets: rank, world size, a free port); the first failure stops the others. Returns
    0, or the first failed process's status."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # one thread per process: they share the cores
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    base |= {"MASTER_PORT": str(port), "WORLD_SIZE": str(count)}
    base |= {"LOCAL_WORLD_SIZE": str(count)}
    procs = [
        subprocess.Popen([*cmd, "--worker"], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(count)
    ]
    status = 0
    try:
        while procs:
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code and not status:
                    status = code
                    for other in procs:  # peers would wait for it until their timeout
                        other.terminate()
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
    return status


def _describe(layout: Layout, plan_file: str | None) -> str:
    cut = f"stage_layers {list(layout.stage_layers)}"
    if layout.recomputes:
        cut += f", recompute {list(layout.recompute)}"
    source = f" (plan {plan_file})" if plan_file else ""
    return (
        describe_shape(layout.schedule, layout.ranks, layout.stages_per_rank, layout.microbatches)
        + f", {cut}{source}"
    )


#: a worker's exit status when the library refused the configuration (the launcher exits 2)
_REFUSED = 3


def _worker(config: TrainConfig, layout: Layout) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device_kind = _resolve_device(config, layout)
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout))
    try:
        try:
            run = train(config, device)
        except Refused as e:
            if dist.get_rank() == 0:
                print(f"pipetrain train: error: {e}", file=sys.stderr)
            return _REFUSED
        if dist.get_rank() == 0:
            print(run.report)
        # Tear down together: a gloo group destroyed while a peer is still busy (rank 0 writing
        # the report) can abort the process at exit.
        dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


__all__ = ["run_train", "start_processes"]
