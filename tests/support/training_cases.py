"""A tiny float64 language model as a list of layers, and per-rank cases for the training tests.

The model is GPT-2 shaped where it matters: a token embedding whose weight the LM head reuses
(one ``Parameter`` in the first and the last layer: a tied weight across stages), blocks that
take an ``attention_mask`` side input, and a padded next-token loss (``ignore_index``) whose rows
hold different numbers of real tokens. The reference is the same layer list run unsplit in one
process; every rank computes it and compares its own parameters by global name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from runtime_cases import _error_of
from torch import nn

VOCAB, WIDTH, SEQ = 11, 6, 5
IGNORE = -100


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH, dtype=torch.float64) * 0.5)

    def forward(self, tokens):
        return F.embedding(tokens, self.weight)


class Block(nn.Module):
    """A residual block; the mask (a side input) zeroes padded positions' updates."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH, dtype=torch.float64)

    def forward(self, h, attention_mask=None):
        update = torch.tanh(self.lin(h))
        if attention_mask is not None:
            update = update * attention_mask.unsqueeze(-1)
        return h + update


class Head(nn.Module):
    def __init__(self, embed: Embed | None) -> None:
        super().__init__()
        if embed is None:
            self.weight = nn.Parameter(torch.randn(VOCAB, WIDTH, dtype=torch.float64) * 0.5)
        else:
            self.weight = embed.weight  # tied: the same Parameter object

    def forward(self, h):
        return h @ self.weight.t()


def layer_count(num_stages: int) -> int:
    return num_stages + 1


def stage_counts(num_stages: int) -> list[int]:
    return [2] + [1] * (num_stages - 1)


def build_layers(num_layers: int, tie: bool = True, seed: int = 0) -> dict[str, nn.Module]:
    """``embed``, ``blocks.<i>`` and ``head`` (names as in a model's state dict)."""
    torch.manual_seed(seed)
    embed = Embed()
    layers: dict[str, nn.Module] = {"embed": embed}
    for i in range(num_layers - 2):
        layers[f"blocks.{i}"] = Block()
    layers["head"] = Head(embed if tie else None)
    return layers


def batch(rows: int, seed: int = 0):
    """Tokens, shifted targets padded with ``IGNORE`` (a different amount per row), and a mask
    that zeroes block updates at other positions than the padding (so it changes the loss)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    lengths = torch.randint(1, SEQ + 1, (rows,), generator=g)
    pad = torch.arange(SEQ)[None, :] >= lengths[:, None]
    targets[pad] = IGNORE
    mask = (torch.rand(rows, SEQ, generator=g) > 0.3).to(torch.float64)  # not the padding
    return tokens, targets, mask


def run_unsplit(layers, tokens, mask=None):
    h = tokens
    for name, layer in layers.items():
        h = (
            layer(h, attention_mask=mask)
            if name.startswith("blocks") and mask is not None
            else (layer(h))
        )
    return h


def reference_loss(logits, targets, reduction: str):
    flat = logits.reshape(-1, VOCAB), targets.reshape(-1)
    if reduction == "token_mean":
        return F.cross_entropy(*flat, ignore_index=IGNORE)
    return F.cross_entropy(*flat, ignore_index=IGNORE, reduction="sum")


def sum_loss(logits, targets):
    return F.cross_entropy(
        logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )


def by_name(layers: dict[str, nn.Module]) -> dict[str, nn.Parameter]:
    """Every parameter of a layer dict by its global name (a tied one under both names)."""
    return {
        f"{layer_name}.{k}": q
        for layer_name, layer in layers.items()
        for k, q in layer.named_parameters(remove_duplicate=False)
    }


def close(a, b, rtol=1e-10) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool((a - b).norm() <= rtol * b.norm() + 1e-14)


def legal_microbatches(name: str, world: int) -> int:
    from pipetrain.schedule.registry import build_schedule

    for m in range(2, 4 * world + 4):
        try:
            build_schedule(name, world, m)
            return m
        except ValueError:
            continue
    raise AssertionError(f"no micro-batch count for {name}")


def _recorder(fired: dict, seen: dict, name: str):
    def hook(p):
        fired[name] = fired.get(name, 0) + 1
        seen[name] = p.grad.clone()

    return hook


def run_losses_tied_clipping(rank: int, world: int, cases: list) -> list[str]:
    """Per (schedule, reduction, defer, side, declared): two steps, loss and every gradient
    against the unsplit model (tied embedding/head), hooks once per step with the whole
    gradient, then ``clip_grad_norm_`` against torch's on the unsplit model.

    ``declared``: the layers are built untied (the head with its own random weight) and the tie
    is declared by name, ``Pipeline(tied=...)``: construction makes the replicas equal."""
    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy
    from pipetrain.schedule.registry import family

    failures = []
    for name, reduction, defer, side, declared in cases:
        v = family(name).default_stages_per_rank
        num_stages = world * v
        m = legal_microbatches(name, world)
        layers = build_layers(layer_count(num_stages), tie=not declared)
        stages = pipetrain.split(layers, stage_counts(num_stages))
        fired: dict[str, int] = {}
        seen: dict[str, torch.Tensor] = {}
        loss_fn = TokenCrossEntropy(IGNORE) if reduction == "token_mean" else sum_loss
        pipe = pipetrain.Pipeline(
            stages,
            name,
            m,
            loss_fn,
            loss_reduction=None if reduction == "token_mean" else reduction,
            defer_weight_grads=defer,
            tied=[("embed.weight", "head.weight")] if declared else (),
        )
        local = {}
        for s in pipe.modules.values():
            for n, p in s.named_parameters(remove_duplicate=False):
                local[n] = p
        for n, p in local.items():
            if n != "head.weight" or local.get("embed.weight") is not p:
                p.register_post_accumulate_grad_hook(_recorder(fired, seen, n))
        tokens, targets, mask = batch(2 * m + 1, seed=m)
        kwargs = {"side": {"attention_mask": mask}} if side else {}
        losses = [pipe.step(tokens, targets, **kwargs) for _ in range(2)]
        case = f"{name} ranks={world} m={m} {reduction} defer={defer} side={side} {declared=}"
        ref_layers = build_layers(layer_count(num_stages))
        for _ in range(2):
            ref_loss = reference_loss(
                run_unsplit(ref_layers, tokens, mask if side else None), targets, reduction
            )
            ref_loss.backward()
        ref = by_name(ref_layers)
        for i, loss in enumerate(losses):
            if not close(loss, ref_loss.detach()):
                failures.append(f"{case}: step {i} loss {loss.item()} != {ref_loss.item()}")
        for n, p in local.items():
            if not close(p.grad, ref[n].grad):
                failures.append(f"{case}: {n} gradient differs")
        counts = sorted(set(fired.values()))
        if counts != [2]:
            failures.append(f"{case}: hooks fired {fired}, expected twice each (once per step)")
        for n, g in seen.items():
            if not torch.equal(g, local[n].grad):
                failures.append(f"{case}: {n}'s hook saw a partial gradient")
        norm = pipe.clip_grad_norm_(0.5)
        ref_params = list({id(p): p for p in ref.values()}.values())
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, 0.5)
        if not close(norm, ref_norm):
            failures.append(f"{case}: norm {norm.item()} != unsplit {ref_norm.item()}")
        for n, p in local.items():
            if not close(p.grad, ref[n].grad):
                failures.append(f"{case}: {n} clipped gradient differs")
        inf_norm = pipe.clip_grad_norm_(1e9, float("inf"))
        ref_inf = torch.nn.utils.clip_grad_norm_(ref_params, 1e9, float("inf"))
        if not close(inf_norm, ref_inf):
            failures.append(f"{case}: inf-norm {inf_norm.item()} != unsplit {ref_inf.item()}")
    return failures


class CheckpointedBlock(Block):
    """A block whose update runs under ``torch.utils.checkpoint``; counts its forward runs."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.runs = 0

    def update(self, h, attention_mask):
        self.runs += 1
        out = torch.tanh(self.lin(h))
        return out * attention_mask.unsqueeze(-1)

    def forward(self, h, attention_mask=None):
        from torch.utils.checkpoint import checkpoint

        return h + checkpoint(self.update, h, attention_mask, use_reentrant=self.reentrant)


def checkpointed_layers(num_layers: int, reentrant: bool = False) -> dict[str, nn.Module]:
    layers = build_layers(num_layers)
    torch.manual_seed(5)
    for name in layers:
        if name.startswith("blocks"):
            layers[name] = CheckpointedBlock(reentrant)
    return layers


def run_activation_checkpointing(rank: int, world: int) -> dict:
    """Exactness and forward runs per micro-batch of a checkpointed block, per schedule and
    weight-gradient split; then ``use_reentrant=True`` refused at the first step."""
    from datetime import timedelta

    import torch.distributed as dist

    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy

    out: dict = {"exact": [], "runs": {}}
    for name, defer in [("1f1b", False), ("zbv", False), ("zbv", True), ("dualpipev", False)]:
        num_stages = 2 * world if name != "1f1b" else world
        m = 4
        layers = checkpointed_layers(layer_count(num_stages))
        pipe = pipetrain.Pipeline(
            pipetrain.split(layers, stage_counts(num_stages)),
            name,
            m,
            TokenCrossEntropy(IGNORE),
            defer_weight_grads=defer,
        )
        tokens, targets, mask = batch(8, seed=3)
        loss = pipe.step(tokens, targets, side={"attention_mask": mask})
        ref_layers = checkpointed_layers(layer_count(num_stages))
        ref_loss = reference_loss(run_unsplit(ref_layers, tokens, mask), targets, "token_mean")
        ref_loss.backward()
        ok = close(loss, ref_loss.detach())
        ref = by_name(ref_layers)
        for s in pipe.modules.values():
            for n, p in s.named_parameters():
                ok &= close(p.grad, ref[n].grad)
        out["exact"].append((name, defer, ok))
        blocks = [
            b
            for s in pipe.modules.values()
            for b in s.modules()
            if isinstance(b, CheckpointedBlock)
        ]
        if blocks:
            out["runs"][f"{name} defer={defer}"] = sum(b.runs for b in blocks) / (len(blocks) * m)
    group = dist.new_group(list(range(world)))
    pipe = pipetrain.Pipeline(
        pipetrain.split(checkpointed_layers(layer_count(world), True), stage_counts(world)),
        "1f1b",
        2,
        TokenCrossEntropy(IGNORE),
        group=group,
        timeout=timedelta(seconds=3),
    )
    tokens, targets, mask = batch(4)
    try:
        pipe.step(tokens, targets, side={"attention_mask": mask})
        out["reentrant"] = "no error"
    except Exception as e:  # the test checks the type and message
        out["reentrant"] = f"{type(e).__name__}: {e}"
    return out


def run_refusals_and_eval(rank: int, world: int) -> dict:
    """Bad training input refused the same way on every rank (no rank left waiting), and
    ``eval_step`` with side inputs against the unsplit model."""
    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy

    def pipe(**kwargs):
        layers = build_layers(layer_count(world))
        loss = kwargs.pop("loss_fn", TokenCrossEntropy(IGNORE))
        return pipetrain.Pipeline(
            pipetrain.split(layers, stage_counts(world)), "1f1b", 2, loss, **kwargs
        )

    tokens, targets, mask = batch(4)
    # a step that fails closes its pipeline (docs/runtime.md): each refusal gets a fresh one
    out = {
        "reduction": _error_of(lambda: pipe(loss_reduction="median")),
        "tied_name": _error_of(lambda: pipe(tied=[("embed.weight", "nope.weight")])),
        "side_name": _error_of(lambda: pipe().step(tokens, targets, side={"attn_mask": mask})),
        "side_grad": _error_of(
            lambda: pipe().step(tokens, targets, side={"attention_mask": mask.requires_grad_()})
        ),
        "no_tokens": _error_of(lambda: pipe().step(tokens, torch.full_like(targets, IGNORE))),
    }
    mask = mask.detach()
    result = pipe().eval_step(tokens, side={"attention_mask": mask})
    expected = run_unsplit(build_layers(layer_count(world)), tokens, mask).detach()
    out["eval_close"] = None if result is None else close(result, expected)
    return out


def run_hand_cut_tie(rank: int, world: int) -> dict:
    """Hand-cut stages (local names that repeat across stages) on zbv: the embedding/head
    ``Parameter`` sits in stages 0 and 3, both on rank 0, found by identity; exact, and its hook
    fires once per step with the whole gradient."""
    import pipetrain
    from pipetrain.runtime.losses import TokenCrossEntropy

    def stages_of(layers):
        blocks = [layers[f"blocks.{i}"] for i in range(4)]
        return [
            nn.Sequential(layers["embed"], blocks[0]),
            nn.Sequential(blocks[1]),
            nn.Sequential(blocks[2]),
            nn.Sequential(blocks[3], layers["head"]),
        ]

    layers = build_layers(6)
    pipe = pipetrain.Pipeline(stages_of(layers), "zbv", 4, TokenCrossEntropy(IGNORE))
    fired: dict = {}
    seen: dict = {}
    for p in pipe.parameters():  # each once
        p.register_post_accumulate_grad_hook(_recorder(fired, seen, f"{id(p)}"))
    tokens, targets, _ = batch(8)
    losses = [pipe.step(tokens, targets) for _ in range(2)]
    ref_layers = build_layers(6)
    for _ in range(2):
        ref_loss = reference_loss(run_unsplit(ref_layers, tokens), targets, "token_mean")
        ref_loss.backward()
    ok = all(close(loss, ref_loss.detach()) for loss in losses)
    mine, theirs = stages_of(layers), stages_of(ref_layers)
    for s in pipe.modules:
        for p, q in zip(mine[s].parameters(), theirs[s].parameters()):
            ok &= close(p.grad, q.grad)
    whole = all(
        torch.equal(seen[f"{id(p)}"], p.grad) for s in pipe.modules.values() for p in s.parameters()
    )
    return {"exact": ok, "hook_counts": sorted(set(fired.values())), "whole": whole}


def run_two_ranks(rank: int, world: int, cases: list) -> dict:
    """Everything the 2-rank tests check, in one launch (the refused reentrant case last)."""
    return {
        "exact": run_losses_tied_clipping(rank, world, cases),
        "refusals": run_refusals_and_eval(rank, world),
        "hand_cut_tie": run_hand_cut_tie(rank, world),
        "activation_checkpointing": run_activation_checkpointing(rank, world),
    }


def run_four_ranks(rank: int, world: int, cases: list, path: str) -> dict:
    """Everything the 4-rank tests check, in one launch."""
    from checkpoint_cases import run_checkpoints
    from fsdp_checkpoint_cases import fsdp_train_resume, run_data_parallel_checkpoints

    return {
        "exact": run_losses_tied_clipping(rank, world, cases),
        "checkpoints": run_checkpoints(rank, world, path),
        "data_parallel_checkpoints": run_data_parallel_checkpoints(rank, world, path),
        "fsdp_train_resume": fsdp_train_resume(rank, world, f"{path}-train"),
    }
