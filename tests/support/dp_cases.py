"""Per-rank runners for the data-parallel tests (inside processes ``runtime_harness`` spawns).

Four gloo ranks form a ``("dp", "pp")`` mesh of 2 × 2. Every rank builds the same float64 model
(seeded), steps on its replica's half of a global batch, and compares the global loss and its
own stages' gradients (FSDP2's gathered from the shards) with the unsplit model trained in one
process on the whole batch.
"""

from __future__ import annotations

import torch
from runtime_cases import _error_of
from torch import nn

WIDTH = 6


class Block(nn.Module):
    """A linear, a LayerNorm (finished in ``I`` when linears defer) and, on the first stage, a
    frozen bias."""

    def __init__(self, frozen: bool) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        if frozen:
            self.a.bias.requires_grad_(False)

    def forward(self, h):
        return self.norm(torch.tanh(self.a(h))) + h


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, h):
        return self.out(torch.sin(self.a(h)))


def build_stages(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(7)
    blocks = [Block(frozen=i == 0) for i in range(num_stages - 1)]
    return [m.double() for m in [*blocks, Head()]]


def loss_fn(out, y):
    return nn.functional.mse_loss(out, y)


def sum_loss(out, y):
    return nn.functional.mse_loss(out, y, reduction="sum")


def token_loss(out, y):
    """Cross entropy summed over the targets that are not ``IGNORE`` (``"token_mean"``)."""
    return nn.functional.cross_entropy(out, y, ignore_index=IGNORE, reduction="sum")


IGNORE = -100
#: variant suffix -> (loss for a micro-batch, Pipeline's loss_reduction, the unsplit loss)
LOSSES = {
    "": (loss_fn, "mean", loss_fn),
    "sum": (sum_loss, "sum", sum_loss),
    "tokens": (
        token_loss,
        "token_mean",
        lambda out, y: nn.functional.cross_entropy(out, y, ignore_index=IGNORE),
    ),
}


def class_targets(y):
    """Class targets from ``y`` with about a third of them ``IGNORE`` (a padded batch)."""
    t = (y[:, 0] > 0).long()
    t[y[:, 1] > 0.4] = IGNORE
    return t


def global_batch(rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, WIDTH, generator=g, dtype=torch.float64)
    y = torch.randn(rows, 2, generator=g, dtype=torch.float64)
    return x, y


def reference(num_stages: int, x, y, steps: int, loss_of=loss_fn):
    stages = build_stages(num_stages)
    for _ in range(steps):
        h = x
        for m in stages:
            h = m(h)
        loss = loss_of(h, y)
        loss.backward()
    grads = {(s, n): p.grad for s, m in enumerate(stages) for n, p in m.named_parameters()}
    return loss.detach(), grads


def _close(a, b, rtol=1e-10) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool((a - b).norm() <= rtol * b.norm() + 1e-14)


def _full(grad):
    """A gradient as one plain tensor (an FSDP2 gradient is a sharded DTensor: gather it)."""
    if grad is None:
        return None
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _count_syncs(pipe, counts: dict) -> None:
    """Count DDP bucket all-reduces (a comm hook) per stage."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    for s, ddp in pipe.data_parallel.wrappers.items():
        if pipe.data_parallel.reduction != "mean":
            continue  # its own hook is registered

        def hook(group, bucket, s=s):
            counts[s] = counts.get(s, 0) + 1
            return allreduce_hook(group, bucket)

        ddp.register_comm_hook(pipe.data_parallel.group, hook)


def run_data_parallel(rank: int, world: int, cases: list[tuple[str, str, bool]]) -> dict:
    """Each (kind, schedule, defer_weight_grads): two steps on a 2 × 2 mesh against the unsplit
    model on the global batch; returns failures and the number of reductions per stage."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    import pipetrain
    from pipetrain.schedule.registry import family

    reduce_scatters = {"n": 0}
    original = DefaultReduceScatter.__call__

    def counting(self, *args, **kwargs):
        reduce_scatters["n"] += 1
        return original(self, *args, **kwargs)

    DefaultReduceScatter.__call__ = counting

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
    replica = mesh.get_local_rank("dp")
    failures: list[str] = []
    syncs: dict[str, object] = {}
    m, steps, local = 4, 2, 9
    for variant, name, defer in cases:
        case = f"{variant} {name} defer={defer}"
        if "-tied" in variant:
            syncs[case] = _tied_case(mesh, replica, variant, name, defer, failures)
            continue
        kind = variant.split("-")[0]
        num_stages = 2 * family(name).default_stages_per_rank
        stages = build_stages(num_stages)
        if variant == "fsdp-nested":  # the caller shards a layer inside each stage first
            for stage in stages:
                fully_shard(stage.a, mesh=mesh["dp"])
        # "-sum": a summed loss; "-tokens": cross entropy over the tokens that are not
        # ignored, normalised by their count over the whole global batch (both replicas)
        suffix = variant.split("-")[1] if variant.count("-") else ""
        loss, reduction, unsplit_loss = LOSSES.get(suffix, LOSSES[""])
        pipe = pipetrain.Pipeline(
            stages,
            name,
            m,
            loss,
            mesh=mesh,
            data_parallel=kind,
            defer_weight_grads=defer,
            loss_reduction=reduction,
            ignore_index=IGNORE if suffix == "tokens" else None,
        )
        counts: dict[int, int] = {}
        if kind == "ddp":
            _count_syncs(pipe, counts)
        reduce_scatters["n"] = 0
        x, y = global_batch(2 * local)
        if suffix == "tokens":
            y = class_targets(y)
        mine = slice(replica * local, (replica + 1) * local)
        losses = [pipe.step(x[mine], y[mine]) for _ in range(steps)]
        out = pipe.eval_step(x[mine])  # forward only: gathers (FSDP), keeps the gradients
        ref_loss, ref_grads = reference(num_stages, x, y, steps, unsplit_loss)
        if out is not None:
            h = x[mine]
            for m_ in build_stages(num_stages):
                h = m_(h)
            if not _close(out, h.detach()):
                failures.append(f"{case}: eval_step output differs")
        for i, loss in enumerate(losses):
            if not _close(loss, ref_loss):
                failures.append(f"{case}: step {i} loss {loss.item()} != {ref_loss.item()}")
        for s in sorted(pipe.modules):
            for n, p in stages[s].named_parameters():
                if not _close(_full(p.grad), ref_grads[(s, n)]):
                    failures.append(f"{case}: stage {s} {n} gradient differs")
        syncs[case] = counts if kind == "ddp" else reduce_scatters["n"]
    out = {"failures": failures, "syncs": syncs, "stages": sorted(pipe.modules)}
    out["errors"] = _errors(mesh, replica)
    return out


def _tied_case(mesh, replica: int, variant: str, name: str, defer, failures: list) -> dict:
    """GPT-2's tied embedding/head (``training_cases``' model, cut by ``pipetrain.split``) under
    DDP or FSDP2: two steps, the loss, every gradient and the tied weight's hooks (once per step, whole
    gradient), ``clip_grad_norm_``, an SGD step and one more step, against the unsplit model on
    the global batch. Returns the DDP bucket all-reduces per stage."""
    import torch.nn.functional as F
    from training_cases import IGNORE as PAD
    from training_cases import VOCAB, batch, build_layers, layer_count, run_unsplit, stage_counts

    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy
    from pipetrain.schedule.registry import family

    case = f"{variant} {name} defer={defer}"
    tokens_mean = variant.endswith("tokens")
    num_stages = 2 * family(name).default_stages_per_rank
    layers = build_layers(layer_count(num_stages))
    tokens, targets, _ = batch(16, seed=3)
    if not tokens_mean:
        targets = targets.clamp(min=0)  # no padding: a plain mean over every token

    def mean_loss(logits, y):  # with padding: the mean over the tokens that are not PAD
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), ignore_index=PAD)

    unsplit_loss = mean_loss

    pipe = pipetrain.Pipeline(
        pipetrain.split(layers, stage_counts(num_stages)),
        name,
        4,
        TokenCrossEntropy(PAD) if tokens_mean else mean_loss,
        mesh=mesh,
        data_parallel=variant.split("-")[0],
        defer_weight_grads=defer,
    )
    counts: dict[int, int] = {}
    if pipe.data_parallel.kind == "ddp":
        _count_syncs(pipe, counts)
    local = {n: p for m in pipe.modules.values() for n, p in m.named_parameters()}
    if pipe.data_parallel.kind == "fsdp":  # the tied weight stays whole, the rest is sharded
        sharded = {n for n, p in local.items() if hasattr(p, "full_tensor")}
        if sharded != {n for n in local if not n.endswith(("embed.weight", "head.weight"))}:
            failures.append(f"{case}: sharded parameters {sorted(sharded)}")
    fired: list[torch.Tensor] = []
    for n in ("embed.weight", "head.weight"):
        if n in local:  # one hook per replica object (one object on a V placement's rank 0)
            local[n].register_post_accumulate_grad_hook(lambda q: fired.append(q.grad.clone()))
            break
    mine = slice(replica * 8, (replica + 1) * 8)
    losses = [pipe.step(tokens[mine], targets[mine]) for _ in range(2)]

    ref_layers = build_layers(layer_count(num_stages))
    ref = {f"{k}.{n}": p for k, m in ref_layers.items() for n, p in m.named_parameters()}
    ref["head.weight"] = ref["embed.weight"]
    for _ in range(2):
        ref_loss = unsplit_loss(run_unsplit(ref_layers, tokens), targets)
        ref_loss.backward()
    for i, loss in enumerate(losses):
        if not _close(loss, ref_loss.detach()):
            failures.append(f"{case}: step {i} loss {loss.item()} != {ref_loss.item()}")
    for n, p in local.items():
        if not _close(_full(p.grad), ref[n].grad):
            failures.append(f"{case}: {n} gradient differs")
    tied = [local[n] for n in ("embed.weight", "head.weight") if n in local]
    if tied and (len(fired) != 2 or not torch.equal(fired[-1], tied[0].grad)):
        failures.append(f"{case}: tied hook fired {len(fired)} times, or saw a partial gradient")
    norm = pipe.clip_grad_norm_(0.05)
    ref_params = list({id(p): p for p in ref.values()}.values())
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.05)
    if not _close(norm, ref_norm):
        failures.append(f"{case}: norm {norm.item()} != unsplit {ref_norm.item()}")
    for n, p in local.items():
        if not _close(_full(p.grad), ref[n].grad):
            failures.append(f"{case}: {n} clipped gradient differs")
    torch.optim.SGD(list(pipe.parameters()), lr=0.5).step()
    torch.optim.SGD(ref_params, lr=0.5).step()
    for n, p in local.items():
        if not _close(_full(p.detach()), ref[n].detach()):
            failures.append(f"{case}: {n} differs after clipping and an SGD step")
    # the replicas stayed equal: a third step's loss is the updated unsplit model's
    loss = pipe.step(tokens[mine], targets[mine])
    with torch.no_grad():
        ref_loss = unsplit_loss(run_unsplit(ref_layers, tokens), targets)
    if not _close(loss, ref_loss):
        failures.append(f"{case}: loss after the update {loss.item()} != {ref_loss.item()}")
    return counts


class Unused(Block):
    def __init__(self) -> None:
        super().__init__(frozen=False)
        self.spare = nn.Parameter(torch.ones(2, dtype=torch.float64))


def _errors(mesh, replica: int) -> dict[str, str]:
    """Refusals, each before any rank could go on with wrong numbers (same on every rank)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import pipetrain

    def pipe(stages, **kw):
        return pipetrain.Pipeline(stages, "1f1b", 2, loss_fn, **kw)

    out = {}
    out["mesh_alone"] = _error_of(lambda: pipe(build_stages(2), mesh=mesh))
    out["bad_kind"] = _error_of(lambda: pipe(build_stages(2), mesh=mesh, data_parallel="zero"))
    out["group_and_mesh"] = _error_of(
        lambda: pipe(build_stages(2), mesh=mesh, data_parallel="ddp", group=dist.group.WORLD)
    )
    dp_group = mesh.get_group("dp")
    stages = build_stages(2)
    stages = [DistributedDataParallel(m, process_group=dp_group) for m in stages]
    out["wrapped_ddp"] = _error_of(lambda: pipe(stages, mesh=mesh, data_parallel="ddp"))
    stages = build_stages(2)
    for m in stages:
        fully_shard(m, mesh=mesh["dp"])
    out["fsdp_without_mesh"] = _error_of(lambda: pipe(stages, group=mesh.get_group("pp")))
    ddp = pipe(build_stages(2), mesh=mesh, data_parallel="ddp")
    x, y = global_batch(9 + replica)
    out["unequal_batches"] = _error_of(lambda: ddp.step(x, y))
    from training_cases import build_layers, layer_count, stage_counts

    tied = pipetrain.split(build_layers(layer_count(2)), stage_counts(2))
    for stage in tied:  # shards the tied weight too
        fully_shard(stage, mesh=mesh["dp"])
    out["tied_sharded"] = _error_of(lambda: pipe(tied, mesh=mesh, data_parallel="fsdp"))
    for kind in ("ddp", "fsdp"):
        stages = [Unused().double(), build_stages(2)[1]]
        stages[1].spare = nn.Parameter(torch.ones(2, dtype=torch.float64))
        bad = pipe(stages, mesh=mesh, data_parallel=kind)
        out[f"unused_{kind}"] = _error_of(lambda bad=bad: bad.step(x[:8], y[:8]))
    return out
