"""Per-rank runners for the real-model training tests (``test_hf_train``): ``Pipeline.from_plan``
against the unsplit model, ``pipetrain train``'s loop run k steps straight against j steps,
a checkpoint and a resume, and that loop on the pipeline alone (the losses ``--tp 2`` must
follow) — all in float64 on gloo, in one launch."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def train_args(*argv: str):
    """``pipetrain train``'s flags as the ``TrainConfig`` the command line builds from them."""
    from pipetrain.cli.train_command import config_from_argv

    return config_from_argv(argv)


def from_plan_gradients(rank: int, world: int) -> dict:
    """Gradients of one step of ``Pipeline.from_plan`` (a plan dict and a ``Plan``) and of the
    unsplit model, by global name, largest relative error per plan; and the refusal of a plan
    for another world size."""
    from pipetrain.app.catalog import ModelShape, build
    from pipetrain.planner import Layout, Plan
    from pipetrain.runtime.pipeline import Pipeline

    shape = ModelShape(
        model="llama", blocks=3, hidden=16, heads=4, kv_heads=2, vocab=256, seq_len=8,
        dtype="float64", seed=5,
    )  # fmt: skip
    tokens = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(1))
    reference = build(shape)
    full = torch.nn.Sequential(*reference.layers.values())
    reference.loss_fn(full(tokens), tokens).backward()
    expected = {n: p.grad for n, p in _named(reference.layers).items()}
    plans = {
        "dict zbv": {"schedule": "zbv", "ranks": 2, "stages_per_rank": 2, "microbatches": 4,
                     "stage_layers": [2, 1, 2, 1], "predicted": {"step_ms": 1.0}},
        "Plan 1f1b": Plan(layout=Layout(schedule="1f1b", ranks=2, stages_per_rank=1,
                                        microbatches=2, stage_layers=(4, 2)),
                          step_ms=1.0, bubble_fraction=0.0, peak_gib=(0.0, 0.0), memory_gib=1.0),
        "Layout 1f1b": Layout(schedule="1f1b", ranks=2, stages_per_rank=1, microbatches=2,
                              stage_layers=(3, 3)),
    }  # fmt: skip
    errors = {}
    for label, plan in plans.items():
        model = build(shape)
        pipe = Pipeline.from_plan(model.layers, plan, loss_fn=model.loss_fn, device="cpu")
        pipe.step(tokens, tokens)
        mine = {n: p.grad for n, p in _named(model.layers).items() if p.grad is not None}
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        got = {n: g for part in gathered for n, g in part.items()}
        assert got.keys() == expected.keys(), (label, sorted(got.keys() ^ expected.keys()))
        errors[label] = max(
            float((got[n] - g).abs().max() / g.abs().max().clamp_min(1e-300))
            for n, g in expected.items()
        )
        pipe.close()
    try:
        Pipeline.from_plan(build(shape).layers, {**plans["dict zbv"], "ranks": 4,
                           "stage_layers": [1] * 6 + [0, 0]}, loss_fn=reference.loss_fn)  # fmt: skip
        refusal = ""
    except ValueError as e:
        refusal = str(e)
    return {"errors": errors, "refusal": refusal}


def _named(layers) -> dict[str, torch.nn.Parameter]:
    return {
        f"{name}.{p_name}": p
        for name, layer in layers.items()
        for p_name, p in layer.named_parameters()
    }


def resume_runs(rank: int, world: int, directory: str) -> dict:
    """``pipetrain train``'s loop (tied Llama, clipping, float64, 2 ranks): 4 steps straight;
    2 steps with a checkpoint, then a resume to step 4."""
    from pipetrain.app.train import train

    common = ["--model", "llama", "--tie-embeddings", "--clip-grad-norm", "0.5", "--dtype",
              "float64", "--layers", "2", "--hidden", "16", "--seq-len", "16", "-s", "zbv",
              "-m", "4", "--microbatch-size", "2", "--corpus-out", f"{directory}/corpus.txt",
              "--svg", f"{directory}/step.svg", "--timeout", "60"]  # fmt: skip
    straight = train(train_args(*common, "--steps", "4"), torch.device("cpu"))
    ckpt = ["--checkpoint-dir", f"{directory}/ckpt"]
    first = train(train_args(*common, *ckpt, "--steps", "2"), torch.device("cpu"))
    resumed = train(train_args(*common, *ckpt, "--steps", "4", "--resume"), torch.device("cpu"))
    differ = [n for n, v in straight.state.items() if not v.equal(resumed.state.get(n, v + 1))]
    return {
        "straight": straight.losses,
        "first": first.losses,
        "resumed": (resumed.first_step, resumed.losses),
        # tensors are compared here: a queue would pass them through shared memory
        "tensors": len(straight.state),
        "differ": differ + sorted(resumed.state.keys() - straight.state.keys()),
        "report": straight.report,
    }


#: ``pipetrain train``'s flags for the pipeline alone, which ``--tp 2`` must follow
ALONE = ("1f1b", "-p", "2", "-m", "2", "--steps", "3", "--dtype", "float64")


def pipeline_alone_losses(directory: str) -> list[float]:
    """The losses of ``pipetrain train ALONE``'s loop (a worker's ``train``), on 2 ranks."""
    from pipetrain.app.train import train

    files = ("--svg", f"{directory}/alone.svg", "--corpus-out", f"{directory}/alone.txt")
    return train(train_args(*ALONE, *files), torch.device("cpu")).losses


@contextlib.contextmanager
def _trained_pipeline(world: int):
    """A float64 pipeline of one linear per rank after one step and one SGD update, its
    optimizer, and a model shape to name its checkpoints by."""
    from pipetrain.app.catalog import ModelShape
    from pipetrain.runtime.pipeline import Pipeline

    torch.manual_seed(0)
    stages = [torch.nn.Linear(4, 4).double() for _ in range(world)]
    with Pipeline(stages, "1f1b", 2, lambda out, y: ((out - y) ** 2).mean(), device="cpu") as pipe:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        x = torch.randn(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        pipe.step(x, x)
        opt.step()
        shape = ModelShape(model="gpt", blocks=1, hidden=4, heads=1, kv_heads=1, vocab=4,
                           seq_len=4, dtype="float64", seed=0)  # fmt: skip
        yield pipe, opt, shape


def pointer_after_save(rank: int, world: int, directory: str) -> bool:
    """``Checkpoints.save`` on every rank, rank 0 slow to move the ``latest`` pointer: whether
    ``latest`` names the new checkpoint when ``save`` returns on this rank."""
    import time
    from pathlib import Path

    from pipetrain.app.checkpoints import LATEST, Checkpoints

    with _trained_pipeline(world) as (pipe, opt, shape):
        saver = Checkpoints(directory, shape)
        if rank == 0:  # the lead moves the pointer late
            write = Path.write_text

            def slow(self, *args, **kwargs):
                if self.name == f"{LATEST}.tmp":
                    time.sleep(1.0)
                return write(self, *args, **kwargs)

            Path.write_text = slow  # type: ignore[method-assign]
        try:
            path = saver.save(1, pipe, opt)
        finally:
            if rank == 0:
                Path.write_text = write  # type: ignore[method-assign]
        pointer = Path(directory) / LATEST
        return pointer.is_file() and pointer.read_text().strip() == path.name


def resume_refused_on_one_rank(rank: int, world: int, directory: str, empty: str) -> str:
    """A checkpoint saved by every rank; then rank 1 resumes from a directory with none while
    the others resume from the saved one: what each rank's ``resume`` raises."""
    from pipetrain.app.checkpoints import Checkpoints

    with _trained_pipeline(world) as (pipe, opt, shape):
        Checkpoints(directory, shape).save(1, pipe, opt)
        try:
            Checkpoints(empty if rank == 1 else directory, shape).resume(pipe, opt)
        except ValueError as e:
            return str(e)
        return "resumed"
