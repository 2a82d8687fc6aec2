"""Per-rank runners for ``tests/app/test_async_checkpoint.py``: a float64 pipeline trained with
AdamW, checkpointed every few steps by ``app.checkpoints.Checkpoints`` (synchronously or in the
background), optionally killed in the middle of a background write, and resumed.

Run as a script (``python async_checkpoint_cases.py ARGS.json``) it is one process of a world of
one, so that a test can kill it for real while a checkpoint is being written."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections import OrderedDict

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


def background_against_sync(rank: int, world: int, directory: str) -> dict:
    """The same run with synchronous and background checkpoints (keeping 2): the losses of
    both, whether their final parameters are equal, the background checkpoints kept, and
    whether each holds the parameters of its step (plain values: tensors do not outlive a
    rank's exit on the way back)."""
    sync = train(rank, world, f"{directory}/sync", 4, 1, asynchronous=False)
    background = train(rank, world, f"{directory}/async", 4, 1, asynchronous=True, keep=2)
    dist.barrier()
    kept = sorted(p for p in os.listdir(f"{directory}/async") if p.startswith("step-"))
    held = {
        p: _equal(loaded(rank, world, f"{directory}/async/{p}"), sync["saved"][int(p[5:])])
        for p in kept
    }
    return {
        "losses": (sync["losses"], background["losses"]),
        "final_equal": _equal(sync["final"], background["final"]),
        "kept": kept,
        "held": held,
    }


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _main(args_file: str) -> None:
    from runtime_harness import free_port

    args = json.loads(open(args_file).read())
    address = f"tcp://127.0.0.1:{free_port()}"
    dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    torch.set_num_threads(1)
    out = args.pop("out")
    runs = {name: train(0, 1, **run) for name, run in args.items()}
    torch.save(runs, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1])
