"""Models and per-rank case runners for the runtime tests (run inside spawned processes).

The model carries a tuple activation ``(h, mask)`` with a bool mask, has a parameter-free stage,
a frozen bias, an unused parameter and a stage that uses one weight twice, so every case sweeps
the awkward paths of split backward and P2P. The reference is the same model trained unsplit in
one process; every rank computes it locally and compares its own stages.
"""

from __future__ import annotations

import torch
from torch import nn

WIDTH = 6


class Block(nn.Module):
    """Two linears; ``tied`` uses the first one twice (a weight shared inside a stage)."""

    def __init__(self, tied: bool, first: bool) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)
        self.unused = nn.Parameter(torch.ones(3))
        self.tied = tied
        if first:
            self.a.bias.requires_grad_(False)  # frozen

    def forward(self, h, mask):
        h = torch.where(mask, torch.tanh(self.a(h)), h)
        h = self.a(h) if self.tied else self.b(h)
        return torch.sin(h), mask


class Free(nn.Module):
    """A stage without parameters."""

    def forward(self, h, mask):
        return h * 2.0 - h.pow(2) * 0.1, mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 2)

    def forward(self, h, mask):
        return self.out(h * mask)


def make_stage(index: int, num_stages: int) -> nn.Module:
    torch.manual_seed(1000 + index)
    if index == num_stages - 1 and num_stages > 1:
        return Head().double()
    if index == 1 and num_stages > 2:
        return Free()
    if num_stages == 1:
        return nn.Sequential()  # placeholder, replaced below
    return Block(tied=index % 2 == 1, first=index == 0).double()


class Whole(nn.Module):
    """A one-stage model (1 rank, 1 stage per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block(tied=True, first=True)
        self.head = Head()

    def forward(self, h, mask):
        return self.head(*self.block(h, mask))


def build_stages(num_stages: int) -> list[nn.Module]:
    if num_stages == 1:
        torch.manual_seed(1000)
        return [Whole().double()]
    return [make_stage(i, num_stages) for i in range(num_stages)]


def batch(size: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, WIDTH, generator=g, dtype=torch.float64)
    mask = torch.rand(size, WIDTH, generator=g) > 0.3
    y = torch.randn(size, 2, generator=g, dtype=torch.float64)
    return (x, mask), y


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out, y)


def reference(num_stages: int, inputs, y, steps: int):
    """Loss and gradients of unsplit training (gradients accumulated over ``steps``)."""
    stages = build_stages(num_stages)
    loss = None
    for _ in range(steps):
        acts = inputs
        for m in stages:
            out = m(*acts)
            acts = out if isinstance(out, tuple) else (out,)
        loss = loss_fn(acts[0], y)
        loss.backward()
    grads = {
        (s, n): p.grad.clone() if p.grad is not None else None
        for s, m in enumerate(stages)
        for n, p in m.named_parameters()
    }
    return loss.detach(), grads


def close(a, b, rtol=1e-10) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool((a - b).norm() <= rtol * b.norm() + 1e-14)


def legal_microbatches(name: str, world: int) -> list[int]:
    """The smallest legal micro-batch count and, where legal, one not a multiple of ranks."""
    from pipetrain.schedule.registry import build_schedule

    legal = []
    for m in range(1, 4 * world + 4):
        try:
            build_schedule(name, world, m)
        except ValueError:
            continue
        if not legal or (m % world and len(legal) == 1):
            legal.append(m)
        if len(legal) == 2:
            break
    if world == 1 and legal == [1]:
        legal.append(3)
    return legal


def run_equivalence(
    rank: int,
    world: int,
    names: list[str],
    two_groups: bool = False,
    defer_weight_grads: bool = False,
    receive_lead: int | None = 1,
) -> list[str]:
    """Every schedule × legal micro-batch counts: two steps, loss and gradients vs reference.

    ``two_groups``: transfers to lower ranks on a second gloo group, as the runtime does on NCCL
    (gloo alone would not need it: this checks both ends pick the same group for each transfer).
    ``defer_weight_grads``: the Pipeline option of that name (True: I/W split by deferred linear
    GEMMs; False: graph replay; this model's stages would default to deferral).
    ``receive_lead``: the Pipeline option of that name (receives posted late).
    """
    import torch.distributed as dist

    import pipetrain
    from pipetrain.runtime.comm.p2p import Transport
    from pipetrain.schedule.registry import family

    reverse = dist.new_group(list(range(world))) if two_groups else None

    failures = []
    for name in names:
        v = family(name).default_stages_per_rank
        for m in legal_microbatches(name, world):
            num_stages = world * v
            stages = build_stages(num_stages)
            pipe = pipetrain.Pipeline(
                stages,
                schedule=name,
                num_microbatches=m,
                loss_fn=loss_fn,
                defer_weight_grads=defer_weight_grads,
                receive_lead=receive_lead,
            )
            if reverse is not None:
                pipe._transport = Transport(
                    rank, None, pipe.device, pipe._transport.timeout, reverse_group=reverse
                )
            inputs, y = batch(2 * m + 1)
            losses = [pipe.step(inputs, y) for _ in range(2)]
            ref_loss, ref_grads = reference(num_stages, inputs, y, steps=2)
            case = f"{name} ranks={world} m={m}"
            failures += differences(case, pipe, stages, rank, losses, ref_loss, ref_grads)
    return failures


def differences(case, pipe, stages, rank, losses, ref_loss, ref_grads) -> list[str]:
    """Each step's loss and this rank's gradients against the unsplit reference's."""
    found = []
    for i, loss in enumerate(losses):
        if not close(loss, ref_loss):
            found.append(f"{case}: step {i} loss {loss.item()} != {ref_loss.item()}")
    for s in pipe.placement.stages_of_rank(rank):
        for n, p in stages[s].named_parameters():
            if not close(p.grad, ref_grads[(s, n)]):
                found.append(f"{case}: stage {s} {n} gradient differs")
    return found


def _recorder(fired: dict, seen: dict, key):
    def hook(p):
        fired[key] = fired.get(key, 0) + 1
        seen[key] = p.grad.clone()

    return hook


def run_features(rank: int, world: int, defer_weight_grads: bool | None = False) -> dict:
    """Callable stages, eval_step, timeline, hooks, changing batch sizes, nothing left behind."""
    import gc
    import weakref

    import pipetrain
    from pipetrain.schedule import Timeline

    out: dict = {}
    num_stages, m = 2 * world, 4
    fired: dict = {}
    seen: dict = {}  # the gradient each hook saw last
    built: dict = {}

    def stage(i):
        built[i] = build_stages(num_stages)[i]
        for n, p in built[i].named_parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(_recorder(fired, seen, (i, n)))
        return built[i]

    pipe = pipetrain.Pipeline(
        stage, "zbv", m, loss_fn, num_stages=num_stages, defer_weight_grads=defer_weight_grads
    )
    out["local_stages"] = sorted(built)
    out["deferred"] = {s: r.defer_weight_grads for s, r in pipe._runners.items()}
    refs = []
    orig = built[min(built)].forward
    built[min(built)].forward = lambda h, mask: (lambda r: (refs.append(weakref.ref(r[0])), r)[1])(
        orig(h, mask)
    )
    for size in (9, 13, 9):  # a changed batch size rediscovers shapes; going back works too
        for p in pipe.parameters():
            p.grad = None
        inputs, y = batch(size, seed=size)
        loss = pipe.step(inputs, y, timeline=True)
        ref_loss, ref_grads = reference(num_stages, inputs, y, steps=1)
        ok = close(loss, ref_loss) and all(
            close(p.grad, ref_grads[(s, n)]) for s in built for n, p in built[s].named_parameters()
        )
        out.setdefault("exact", []).append(ok)
        # a data-parallel hook sees the step's whole gradient, not a partial sum
        out.setdefault("hook_saw_whole_grad", []).append(
            all(
                torch.equal(seen[(s, n)], p.grad) if p.grad is not None else (s, n) not in seen
                for s in built
                for n, p in built[s].named_parameters()
                if p.requires_grad
            )
        )
    gc.collect()
    out["activations_alive"] = sum(r() is not None for r in refs)
    out["leftovers"] = sum(r.leftovers() + len(r.losses) for r in pipe._runners.values())
    out["hook_counts"] = sorted(set(fired.values()))
    tl = pipe.last_timeline
    out["timeline"] = (
        isinstance(tl, Timeline),
        tl.measured,
        tl.num_ranks,
        len(tl.spans),
        sum(a.is_compute for row in pipe.program.actions for a in row),
    )
    inputs, _ = batch(9)
    result = pipe.eval_step(inputs)
    if result is not None:
        acts = inputs
        for s in build_stages(num_stages):
            o = s(*acts)
            acts = o if isinstance(o, tuple) else (o,)
        out["eval_close"] = close(result, acts[0].detach())
    else:
        out["eval_close"] = None
    return out


def _error_of(fn) -> str:
    try:
        fn()
    except Exception as e:  # the test checks the type name and message
        return f"{type(e).__name__}: {e}"
    return "no error"


class TwoOut(nn.Module):
    def forward(self, h, mask):
        return h, mask


class OneIn(nn.Module):
    def forward(self, h):
        return h.sum(1, keepdim=True)


def run_errors(rank: int, world: int) -> dict:
    """Bad input fails before any transfer; a rank failing mid-step times out its peer clearly."""
    from datetime import timedelta

    import torch.distributed as dist

    import pipetrain
    from pipetrain.schedule.registry import build_schedule

    out = {}
    out["stage_count"] = _error_of(lambda: pipetrain.Pipeline(build_stages(3), "1f1b", 2, loss_fn))
    out["world"] = _error_of(
        lambda: pipetrain.Pipeline(build_stages(4), build_schedule("1f1b", 4, 2), None, loss_fn)
    )
    out["two_copies"] = _error_of(
        lambda: pipetrain.Pipeline(build_stages(4), "dualpipe", 4, loss_fn)
    )
    out["receive_lead"] = _error_of(
        lambda: pipetrain.Pipeline(build_stages(2), "1f1b", 2, loss_fn, receive_lead=-1)
    )
    pipe = pipetrain.Pipeline(build_stages(2), "1f1b", 4, loss_fn)
    inputs, y = batch(3)
    out["too_many_mb"] = _error_of(lambda: pipe.step(inputs, y))
    short = timedelta(seconds=2)
    # Each failing case gets its own group: a dead transfer must not linger into the next case.
    group = dist.new_group([0, 1])
    bad = pipetrain.Pipeline(
        build_stages(2), "1f1b", 2, lambda o, t: (o - t) ** 2, group=group, timeout=short
    )
    inputs, y = batch(4)
    out["non_scalar"] = _error_of(lambda: bad.step(inputs, y))
    group = dist.new_group([0, 1])
    mismatch = pipetrain.Pipeline(
        [TwoOut(), OneIn()], "gpipe", 2, loss_fn, group=group, timeout=short
    )
    out["arity"] = _error_of(lambda: mismatch.step(inputs, y[:, :1]))
    return out


def run_two_pipelines(rank: int, world: int) -> dict:
    """Two Pipelines in one process, one deferring linear weight GEMMs and one replaying graphs,
    their steps interleaved: each stays exact, and neither changes the modules it was given."""
    import pipetrain

    out: dict = {"exact": []}
    num_stages = 2 * world
    deferring, replaying = build_stages(num_stages), build_stages(num_stages)
    kinds_before = [type(m) for stages in (deferring, replaying) for m in _all_modules(stages)]
    inputs, y = batch(11)
    ref_loss, ref_grads = reference(num_stages, inputs, y, steps=2)
    with (
        pipetrain.Pipeline(deferring, "zbv", 4, loss_fn, defer_weight_grads=True) as a,
        pipetrain.Pipeline(replaying, "zbv", 5, loss_fn, defer_weight_grads=False) as b,
    ):
        out["splits"] = sorted(
            {type(r.split).__name__ for p in (a, b) for r in p._runners.values()}
        )
        losses = [(a.step(inputs, y), b.step(inputs, y)) for _ in range(2)]
        for stages, pipe in ((deferring, a), (replaying, b)):
            ok = all(close(la if pipe is a else lb, ref_loss) for la, lb in losses)
            for s in pipe.placement.stages_of_rank(rank):
                ok &= all(close(p.grad, ref_grads[(s, n)]) for n, p in stages[s].named_parameters())
            out["exact"].append(ok)
    out["closed_refuses"] = _error_of(lambda: a.step(inputs, y))
    kinds_after = [type(m) for stages in (deferring, replaying) for m in _all_modules(stages)]
    out["modules_unchanged"] = kinds_before == kinds_after and not any(
        "forward" in m.__dict__ for stages in (deferring, replaying) for m in _all_modules(stages)
    )
    return out


def _all_modules(stages: list[nn.Module]) -> list[nn.Module]:
    return [m for stage in stages for m in stage.modules()]


def run_profiled(rank: int, world: int, names: list[str]) -> dict:
    """Per schedule, one step under ``torch.profiler``: how often each of this rank's action
    labels (``F 3 mb 5``) occurs in its row, and in the profile's events."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    import pipetrain
    from pipetrain.runtime.executor import profile_label

    out: dict = {}
    for name in names:
        with pipetrain.Pipeline(build_stages(2 * world), name, 4, loss_fn) as pipe:
            inputs, y = batch(9)
            pipe.step(inputs, y)  # shapes are learnt here; the profiled step is a steady one
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                pipe.step(inputs, y)
            row = Counter(profile_label(a) for a in pipe.program.actions[rank])
        events = Counter(e.name for e in prof.events())
        out[name] = {"row": dict(row), "profiled": {label: events[label] for label in row}}
    return out
