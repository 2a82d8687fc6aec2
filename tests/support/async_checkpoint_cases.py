"""Per-rank runners for ``tests/app/test_async_checkpoint.py``: a float64 pipeline trained with
AdamW, checkpointed every few steps by ``app.checkpoints.Checkpoints`` (synchronously or in the
background), optionally killed in the middle of a background write, and resumed.
``alone`` runs one in a process of its own, a world of one, so that it can die for real while a
checkpoint is being written."""

from __future__ import annotations

import contextlib
import os
import sys
from collections import OrderedDict
from pathlib import Path

import torch
import torch.distributed as dist


@contextlib.contextmanager
def _pipeline(world: int):
    from pipetrain.app.catalog import ModelShape
    from pipetrain.runtime.pipeline import Pipeline

    torch.manual_seed(0)
    # one linear per rank, each under a name of its own: checkpoints key tensors by name
    stages = [
        torch.nn.Sequential(OrderedDict([(f"layer{r}", torch.nn.Linear(4, 4).double())]))
        for r in range(world)
    ]
    loss = lambda out, y: ((out - y) ** 2).mean()  # noqa: E731
    with Pipeline(stages, "1f1b", 2, loss, device="cpu") as pipe:
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
        dims = dict(blocks=1, hidden=4, heads=1, kv_heads=1, vocab=4, seq_len=4)
        shape = ModelShape(model="gpt", dtype="float64", seed=0, **dims)
        yield pipe, opt, shape


def _params(pipe) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone() for s in pipe.modules for k, v in pipe.modules[s].state_dict().items()
    }


def train(
    rank: int,
    world: int,
    directory: str,
    steps: int,
    every: int,
    asynchronous: bool,
    keep: int | None = None,
    resume: bool = False,
    kill_at: int | None = None,
) -> dict:
    """``steps`` steps (from the latest checkpoint with ``resume``), a checkpoint every
    ``every``; the losses, the final parameters and the parameters at each save. ``kill_at``:
    the process dies (``os._exit(9)``) on the checkpoint write of that step, in the background
    thread, after its files are written and before the folder is renamed."""
    from pipetrain.app.checkpoints import Checkpoints
    from pipetrain.runtime import checkpoint_disk

    Path(directory).mkdir(parents=True, exist_ok=True)

    if kill_at is not None:
        publish = checkpoint_disk.publish

        def dying(partial, final):
            if final.name == f"step-{kill_at:06d}":
                sys.stdout.flush()
                os._exit(9)
            publish(partial, final)

        checkpoint_disk.publish = dying
    said: dict = {"losses": [], "saved": {}}
    with _pipeline(world) as (pipe, opt, shape):
        with Checkpoints(directory, shape, asynchronous=asynchronous, keep=keep) as saver:
            saver.hold()
            start = saver.resume(pipe, opt) if resume else 0
            for step in range(start, steps):
                x = torch.randn(
                    4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(step)
                )
                loss = pipe.step(x, x.flip(0))
                opt.step()
                opt.zero_grad(set_to_none=True)
                said["losses"].append(float(loss))
                if (step + 1) % every == 0:
                    saver.save(step + 1, pipe, opt)
                    said["saved"][step + 1] = _params(pipe)
        said["start"] = start
        said["final"] = _params(pipe)
    return said


def loaded(rank: int, world: int, folder: str) -> dict[str, torch.Tensor]:
    """A checkpoint's parameters as this rank's stages hold them."""
    from pipetrain.runtime.checkpoint import load_checkpoint

    with _pipeline(world) as (pipe, opt, _):
        load_checkpoint(folder, pipe, opt, verify=True)
        return _params(pipe)


def background_against_none(rank: int, world: int, directory: str) -> dict:
    """The same run without checkpoints and with one in the background after every step
    (keeping 2): the losses of both, whether their final parameters are equal, the checkpoints
    kept, and whether each holds the parameters of its step (plain values: tensors do not
    outlive a rank's exit on the way back)."""
    plain = train(rank, world, f"{directory}/none", 3, 4, asynchronous=False)
    background = train(rank, world, f"{directory}/async", 3, 1, asynchronous=True, keep=2)
    dist.barrier()
    kept = sorted(p for p in os.listdir(f"{directory}/async") if p.startswith("step-"))
    held = {
        p: _equal(loaded(rank, world, f"{directory}/async/{p}"), background["saved"][int(p[5:])])
        for p in kept
    }
    return {
        "losses": (plain["losses"], background["losses"]),
        "final_equal": _equal(plain["final"], background["final"]),
        "kept": kept,
        "held": held,
    }


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def alone(run: dict) -> None:
    """``train(**run)`` as the one process of a world of one (a test kills it on purpose)."""
    from runtime_harness import free_port

    torch.set_num_threads(1)
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    train(0, 1, **run)
    dist.destroy_process_group()
