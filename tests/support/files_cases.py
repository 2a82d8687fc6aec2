"""Per-rank runners for ``tests/runtime/test_checkpoint_sums.py``: a damaged checkpoint refused on
resume naming the file and the last good one, and writes that fail under a file-size limit."""

from __future__ import annotations

import errno
import resource
from pathlib import Path

import torch.distributed as dist
from train_cases import _trained_pipeline


def damaged_resume_and_full_disk(rank: int, world: int, directory: str, out: str) -> dict:
    """Two checkpoints saved; a byte of the newest flipped; resume. Then a third save with a
    file-size limit on the last rank only, and (rank 0) an export under the limit."""
    from pipetrain.app.checkpoints import Checkpoints

    said: dict = {}
    with _trained_pipeline(world) as (pipe, opt, shape):
        saver = Checkpoints(directory, shape)
        saver.save(1, pipe, opt)
        newest = saver.save(2, pipe, opt)
        if rank == 0:
            shard = newest / "__1_0.distcp"
            data = bytearray(shard.read_bytes())
            data[-1] ^= 0xFF
            shard.write_bytes(bytes(data))
        dist.barrier()
        try:
            Checkpoints(directory, shape, verify=True).resume(pipe, opt)
            said["resume"] = "resumed"
        except ValueError as e:
            said["resume"] = str(e)
        said["full"] = _limited(rank == world - 1, lambda: saver.save(3, pipe, opt))
        said["partial_left"] = Path(directory, "step-000003.partial").exists()
        said["step3"] = Path(directory, "step-000003").exists()
        if rank == 0:
            said["export"] = _limited(True, lambda: _export(out))
            said["export_left"] = sorted(p.name for p in Path(out).parent.iterdir())
    return said


def _export(out: str) -> None:
    from finetune_cases import build

    from pipetrain.hf.export import write_pretrained

    model = build("llama")
    write_pretrained(dict(model.state_dict()), out, model.config)


def _limited(limited: bool, write) -> tuple | None:
    """``write()`` under a 64-byte file-size limit where ``limited``: the ``OSError``'s errno and
    path, or None where nothing was raised."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limited:
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))
    try:
        write()
    except OSError as e:
        return (errno.errorcode.get(e.errno or 0), e.filename)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    return None


def checkpointed_run(rank: int, world: int, directory: str, folder: str) -> bool:
    """``pipetrain train --model-dir`` 2 steps, a checkpoint each step and ``--export``."""
    import torch
    from finetune_cases import train_args

    from pipetrain.app.train import train

    out = Path(directory)
    if rank == 0:
        from pipetrain.app.models.data import make_corpus

        out.mkdir(parents=True, exist_ok=True)
        (out / "text.txt").write_bytes(make_corpus(2048))
    dist.barrier()
    args = [
        "--model-dir",
        folder,
        "--seq-len",
        "16",
        "--steps",
        "2",
        "--checkpoint-dir",
        str(out / "ckpt"),
        "--checkpoint-every",
        "1",
        "--export",
        str(out / "exported"),
        "--text",
        str(out / "text.txt"),
        "--svg",
        str(out / "step.svg"),
        "--timeout",
        "60",
    ]
    train(train_args(*args), torch.device("cpu"))
    return True
