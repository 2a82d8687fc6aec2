"""Checkpoints of data-parallel pipelines (inside the 4-rank launch of ``test_training_runtime``).

Four gloo ranks, float64, ``training_cases``' untied model (embed, 4 blocks, head). The
uninterrupted run is FSDP2 on a ``(dp, pp)`` mesh of 2 × 2 (zbv, 4 stages), checkpointed after
``BEFORE`` steps. Each replica steps on its half of a global batch with a token-mean loss, so the
replicas' gradients are summed (``a + b``: the same bits in either order). Continuations:

* FSDP2 at the same layout (fresh weights, then the checkpoint): bit for bit;
* DDP at 2 × 2 with another schedule and cut (1F1B, 2 stages), which writes a checkpoint of its
  own one step later — and FSDP2 at the first layout continues from that one;
* the plain model on rank 0, each replica's micro-batches accumulated by hand and the replicas'
  sums added, as the mesh does (these two and DDP's run other layouts: within float64
  round-off, ``ACROSS_LAYOUTS`` in ``test_training_runtime``, since another cut may accumulate
  a linear's weight gradient inside the GEMM where this one adds it after, or the reverse);
* FSDP2 on a mesh of 4 × 1 (pp=1, shards of a quarter): other rows per replica and micro-batch,
  so other summation orders (compared to round-off, the loaded state bit for bit).
"""

from __future__ import annotations

from pathlib import Path

import torch
from checkpoint_cases import AFTER, BEFORE, CKPT_LAYERS, CKPT_MB, _adamw
from runtime_cases import _error_of
from training_cases import IGNORE, batch, build_layers

ROWS = 18  # the global batch: 9 rows per replica at dp=2 (micro-batches of 3 and 2 rows)


def _pipeline(mesh, kind: str, schedule: str, counts: list[int], tie: bool = False):
    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy

    stages = pipetrain.split(build_layers(CKPT_LAYERS, tie=tie, seed=99), counts)
    pipe = pipetrain.Pipeline(
        stages, schedule, CKPT_MB, TokenCrossEntropy(IGNORE), mesh=mesh, data_parallel=kind
    )
    return pipe, _adamw(pipe.parameters())


def _rows(mesh, step: int):
    """This replica's rows of the global batch of ``step`` (equal shares, the first ones larger)."""
    dp, replica = mesh.size(0), mesh.get_local_rank("dp")
    return [t.tensor_split(dp)[replica] for t in batch(ROWS, seed=200 + step)]


def _train(pipe, opt, mesh, steps) -> None:
    for step in steps:
        opt.zero_grad()
        tokens, targets, mask = _rows(mesh, step)
        pipe.step(tokens, targets, side={"attention_mask": mask})
        opt.step()


def _full(pipe) -> dict:
    """Every local parameter whole (an FSDP2 shard gathered: collective over the replicas, in
    the same order on each) as numpy arrays."""
    out = {}
    for s in sorted(pipe.modules):
        for name, t in pipe.modules[s].state_dict().items():
            whole = t.full_tensor() if hasattr(t, "full_tensor") else t
            out[name] = whole.detach().numpy().copy()
    return out


def _placed_like_parameters(opt) -> bool:
    """AdamW's moments of a sharded parameter are DTensors placed like it; ``step`` is plain."""
    from torch.distributed.tensor import DTensor

    ok = True
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state[p]
            for key in ("exp_avg", "exp_avg_sq"):
                v = state[key]
                ok &= isinstance(v, DTensor) and tuple(v.placements) == tuple(p.placements)
                ok &= v.device_mesh == p.device_mesh and v.to_local().shape == p.to_local().shape
            ok &= not isinstance(state["step"], DTensor)
    return bool(ok)


def run_data_parallel_checkpoints(rank: int, world: int, path: str) -> dict:
    """Final (and, for 4 × 1, just-loaded) parameters by name of every run; the test compares."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import pipetrain

    first, second = f"{path}-fsdp", f"{path}-ddp"
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    out: dict = {}
    pipe, opt = _pipeline(mesh, "fsdp", "zbv", [2, 1, 1, 2])
    out["sharded"] = all(isinstance(p, DTensor) for p in pipe.parameters())
    _train(pipe, opt, mesh, range(BEFORE))
    pipetrain.save_checkpoint(first, pipe, opt)
    out["saved"] = _full(pipe)
    _train(pipe, opt, mesh, range(BEFORE, BEFORE + AFTER))
    out["uninterrupted"] = _full(pipe)

    pipe, opt = _pipeline(mesh, "fsdp", "zbv", [2, 1, 1, 2])
    pipe.load_state_dict({n: torch.from_numpy(v) for n, v in out["saved"].items()})
    out["state_dict_loaded"] = _full(pipe)  # whole tensors into shards: Pipeline.load_state_dict
    pipetrain.load_checkpoint(first, pipe, opt)
    out["placed"] = _placed_like_parameters(opt)
    _train(pipe, opt, mesh, range(BEFORE, BEFORE + AFTER))
    out["fsdp"] = _full(pipe)

    pipe, opt = _pipeline(mesh, "ddp", "1f1b", [3, 3])
    pipetrain.load_checkpoint(first, pipe, opt)
    _train(pipe, opt, mesh, range(BEFORE, BEFORE + 1))
    pipetrain.save_checkpoint(second, pipe, opt)
    _train(pipe, opt, mesh, range(BEFORE + 1, BEFORE + AFTER))
    out["ddp"] = _full(pipe)

    pipe, opt = _pipeline(mesh, "fsdp", "zbv", [2, 1, 1, 2])
    pipetrain.load_checkpoint(second, pipe, opt)
    _train(pipe, opt, mesh, range(BEFORE + 1, BEFORE + AFTER))
    out["fsdp_from_ddp"] = _full(pipe)

    if rank == 0:
        out["plain"] = _plain_continuation(first)
    dist.barrier()

    quarters = init_device_mesh("cpu", (4, 1), mesh_dim_names=("dp", "pp"))
    pipe, opt = _pipeline(quarters, "fsdp", "1f1b", [CKPT_LAYERS])
    pipetrain.load_checkpoint(first, pipe, opt)
    out["quarters_loaded"] = _full(pipe)
    _train(pipe, opt, quarters, range(BEFORE, BEFORE + AFTER))
    out["quarters"] = _full(pipe)
    out["tied"] = _tied(mesh, f"{path}-tied")
    out["errors"] = _refusals(rank, mesh, first)
    return out


def _tied(mesh, path: str) -> dict:
    """GPT-2's tied embedding/head across the two pipeline ranks (1F1B, 2 stages): FSDP2 keeps
    it whole (``ignored_params``) and its owners write it under both names. Continued under
    FSDP2 and under DDP at the same layout (the tied sum is the same code in both)."""
    import pipetrain

    pipe, opt = _pipeline(mesh, "fsdp", "1f1b", [3, 3], tie=True)
    _train(pipe, opt, mesh, range(BEFORE))
    pipetrain.save_checkpoint(path, pipe, opt)
    _train(pipe, opt, mesh, range(BEFORE, BEFORE + AFTER))
    out = {"uninterrupted": _full(pipe)}
    for kind in ("fsdp", "ddp"):
        pipe, opt = _pipeline(mesh, kind, "1f1b", [3, 3], tie=True)
        pipetrain.load_checkpoint(path, pipe, opt)
        _train(pipe, opt, mesh, range(BEFORE, BEFORE + AFTER))
        out[kind] = _full(pipe)
    return out


def _refusals(rank: int, mesh, path: str) -> dict[str, str]:
    """A key missing on one pipeline rank only (a block more, on the last stage) is refused on
    every process, not left to hang the others in DCP's collectives; and a mesh that is not the
    whole job is refused before any collective."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy

    stages = pipetrain.split(build_layers(CKPT_LAYERS + 1, tie=False), [3, 4])
    pipe = pipetrain.Pipeline(
        stages, "1f1b", CKPT_MB, TokenCrossEntropy(IGNORE), mesh=mesh, data_parallel="fsdp"
    )
    opt = _adamw(pipe.parameters())
    out = {"missing_on_one_rank": _error_of(lambda: pipetrain.load_checkpoint(path, pipe, opt))}
    pair = DeviceMesh("cpu", torch.tensor([[0], [1]]), mesh_dim_names=("dp", "pp"))
    if rank < 2:  # a (dp, pp) mesh of 2 x 1 in a job of 4
        pipe, opt = _pipeline(pair, "fsdp", "1f1b", [CKPT_LAYERS])
        out["mesh_not_the_job"] = _error_of(lambda: pipetrain.save_checkpoint(path, pipe, opt))
    return out


def _plain_continuation(path: str) -> dict:
    """The plain model continues from the FSDP2 checkpoint: each replica's micro-batches in
    order, then the two replicas' sums added (what the reduce-scatter does)."""
    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy

    (model,) = pipetrain.split(build_layers(CKPT_LAYERS, tie=False, seed=5), [CKPT_LAYERS])
    opt = _adamw(model.parameters())
    pipetrain.load_checkpoint(path, model, opt)
    loss_fn = TokenCrossEntropy(IGNORE)
    params = list(model.parameters())
    for step in range(BEFORE, BEFORE + AFTER):
        tokens, targets, mask = batch(ROWS, seed=200 + step)
        count = (targets != IGNORE).sum().item()
        replicas = []
        for part in zip(*(t.tensor_split(2) for t in (tokens, targets, mask))):
            opt.zero_grad()
            for x, y, mk in zip(*(t.tensor_split(CKPT_MB) for t in part)):
                (loss_fn(model(x, attention_mask=mk), y) * (1.0 / count)).backward()
            replicas.append([p.grad.clone() for p in params])
        for p, a, b in zip(params, *replicas):
            p.grad = a + b
        opt.step()
    return {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}


def fsdp_train_resume(rank: int, world: int, directory: str) -> dict:
    """``pipetrain train``'s loop (its flags, checks and checkpoint directory) with FSDP2 on a
    (dp, pp) mesh of 2 × 2 (the built-in GPT, float64): 4 steps straight; 2 steps with a
    checkpoint, then ``--resume`` to step 4. Losses, and the parameters' shards that differ."""
    import torch
    from train_cases import train_args

    from pipetrain.app.train import train

    common = ["--model", "gpt", "--dtype", "float64", "--layers", "2", "--hidden", "16",
              "--heads", "2", "--seq-len", "16", "-p", "2", "-s", "1f1b", "-m", "2",
              "--microbatch-size", "2", "--dp", "2", "--data-parallel", "fsdp",
              "--corpus-out", f"{directory}/corpus.txt", "--svg", f"{directory}/step.svg",
              "--timeout", "60"]  # fmt: skip
    cpu = torch.device("cpu")
    straight = train(train_args(*common, "--steps", "4"), cpu)
    ckpt = ["--checkpoint-dir", f"{directory}/ckpt"]
    first = train(train_args(*common, *ckpt, "--steps", "2"), cpu)
    resumed = train(train_args(*common, *ckpt, "--steps", "4", "--resume"), cpu)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    return {
        "straight": straight.losses,
        "first": first.losses,
        "resumed": (resumed.first_step, resumed.losses),
        "sharded": sum(hasattr(t, "to_local") for t in straight.state.values()),
        "differ": sorted(
            n
            for n in straight.state.keys() | resumed.state.keys()
            if n not in straight.state
            or n not in resumed.state
            or not local(straight.state[n]).equal(local(resumed.state[n]))
        ),
        "saved": sorted(p.name for p in (Path(directory) / "ckpt").iterdir() if p.name != ".lock"),
    }
