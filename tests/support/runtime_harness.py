"""Launch gloo process groups for runtime tests: one launch runs a whole list of cases.

``launch(world_size, fn, *args)`` starts ``world_size`` processes, initialises a gloo group on a
free local port in each, calls ``fn(rank, world_size, *args)`` and returns every rank's result
(rank order). A rank that raises sends its traceback back; the launch fails with all of them.

Starting processes dominates the runtime suite's time: a fresh interpreter spends seconds in
``import torch`` (and DTensor, FSDP2, transformers), several of them per launch on a small CPU
box. So ranks are forked from one ``forkserver`` that imported those once (``PRELOAD``), and
tests share launches too. The server only imports: no tensor op, thread pool or process group
exists before the fork, so each rank starts as clean as a spawned one and builds its own. (A
rank ends with ``os._exit`` after sending its result, as forked children do: the interpreter's
own teardown is ``tests/runtime/test_runtime_exit.py``'s, with real processes.)
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta

#: what the fork server imports once, before it forks any rank; a module that fails to import
#: is skipped (the rank imports it, or fails, as it would have)
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.nn.parallel",
    "torch.utils.checkpoint",
    "pipetrain.runtime.pipeline",
    "pipetrain.runtime.checkpoint",
    "pipetrain.hf",
    "transformers",
    "transformers.masking_utils",
    *(
        f"transformers.models.{m}.modeling_{m}"
        for m in ("llama", "gpt2", "qwen2", "qwen3", "mistral")
    ),
]


#: ports each pytest-xdist worker hands out: below Linux's ephemeral range (32768 and up, where
#: the kernel picks the ports of outgoing connections and of ``bind(0)``), a block per worker
PORT_BASE, PORT_BLOCK = 20000, 1500
_next_port = itertools.count()


def free_port() -> int:
    """A port no other test of this run is using: the next free one of this pytest-xdist
    worker's own block. Binding port 0 and closing it would race: under parallel workers the
    kernel can hand the same port to another process, or to an outgoing connection, before the
    test's store binds it again."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = PORT_BASE + PORT_BLOCK * (int(worker) if worker.isdigit() else 0)
    start = (os.getpid() * 7) % PORT_BLOCK  # another pytest run beside this one starts elsewhere
    for _ in range(PORT_BLOCK):
        port = base + (start + next(_next_port)) % PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {base}..{base + PORT_BLOCK - 1}")


def _worker(rank, world_size, port, fn, args, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def context():
    """The forkserver context, its preload set (the server starts at the first launch, with
    this process's ``sys.path`` and environment, and serves every later one; each rank still
    takes the launching test's working directory and ``sys.path``). Spawn where there is no
    fork server (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def launch(world_size: int, fn, *args, timeout: float = 120.0) -> list:
    ctx = context()
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world_size)]
