"""Per-rank runners for the varying micro-batch count tests (inside processes ``runtime_harness``
starts): one ``Pipeline`` steps batches of another count each step, against the unsplit model
accumulating gradients over the same micro-batches, in float64."""

from __future__ import annotations

import torch
from torch import nn

from pipetrain.runtime.pipeline import Pipeline

WIDTH, ROWS, IGNORE = 6, 2, -100
#: each step's micro-batch count (the pipeline's own, 4, first and again later); DualPipeV's are
#: all >= 2 x ranks, what it accepts
COUNTS = {"1f1b": (4, 2, 6, 4), "zbv": (4, 1, 5, 4), "dualpipev": (4, 6, 5)}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, h):
        return self.norm(torch.tanh(self.a(h))) + h


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, h):
        return self.out(h)


def _stages(n: int) -> list[nn.Module]:
    torch.manual_seed(5)
    return [m.double() for m in [*(Block() for _ in range(n - 1)), Head()]]


def token_loss(out, y):
    """Cross entropy summed over the targets that are not ``IGNORE`` (``"token_mean"``: the
    pipeline divides by the step's count, as ``causal_lm_token_loss``)."""
    return nn.functional.cross_entropy(out, y, ignore_index=IGNORE, reduction="sum")


def _batch(step: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(count * ROWS, WIDTH, dtype=torch.float64, generator=g)
    y = torch.randint(0, 3, (count * ROWS,), generator=g)
    y[torch.rand(count * ROWS, generator=g) < 0.3] = IGNORE
    y[0] = 1  # one counted target at least
    return x, y


def _unsplit(
    counts: tuple[int, ...], num_stages: int
) -> tuple[nn.Module, list[float], list[dict[str, torch.Tensor]]]:
    """The unsplit model's loss and gradients per step: the token mean over the step, gradients
    accumulated micro-batch by micro-batch."""
    model = nn.Sequential(*_stages(num_stages))
    losses, grads = [], []
    for step, count in enumerate(counts):
        x, y = _batch(step, count)
        model.zero_grad()
        tokens = int((y != IGNORE).sum())
        total = torch.zeros((), dtype=torch.float64)
        for xs, ys in zip(x.chunk(count), y.chunk(count), strict=True):
            loss = token_loss(model(xs), ys) / tokens
            loss.backward()
            total += loss.detach()
        losses.append(float(total))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return model, losses, grads


def run_counts(rank: int, world_size: int, cases) -> list[str]:
    """Each (schedule, stages) case: every step's loss and this rank's gradients against the
    unsplit run; then an ``eval_step`` at the pipeline's own count after the others."""
    failures = []
    for schedule, num_stages in cases:
        ref, losses, grads = _unsplit(COUNTS[schedule], num_stages)
        stages = _stages(num_stages)
        pipe = Pipeline(stages, schedule, 4, token_loss, device="cpu", loss_reduction="token_mean")
        with pipe:
            mine = {s: m for s, m in enumerate(stages) if s in pipe.modules}
            fired: list[tuple[str, torch.Tensor]] = []  # a hook needing the step's whole gradient
            for s, m in mine.items():
                for name, p in m.named_parameters():
                    key = f"{s}.{name}"
                    p.register_post_accumulate_grad_hook(
                        lambda p, key=key, fired=fired: fired.append((key, p.grad.clone()))
                    )
            for step, count in enumerate(COUNTS[schedule]):
                for m in mine.values():
                    m.zero_grad()
                x, y = _batch(step, count)
                fired.clear()
                loss = pipe.step(x, y, num_microbatches=count)
                seen = dict(fired)
                if len(fired) != len(seen) or set(seen) != set(_names(mine)):
                    failures.append(f"{schedule} step {step}: hooks fired for {sorted(fired)}")
                for key, grad in seen.items():
                    if not torch.allclose(grad, grads[step][key], rtol=1e-10, atol=1e-12):
                        failures.append(f"{schedule} step {step}: hook saw a partial {key}")
                if pipe.num_microbatches != count:
                    failures.append(f"{schedule} step {step}: ran {pipe.num_microbatches}")
                if abs(float(loss) - losses[step]) > 1e-12:
                    failures.append(f"{schedule} step {step}: loss {float(loss)} != {losses[step]}")
                for s, m in mine.items():
                    for name, p in m.named_parameters():
                        want = grads[step][f"{s}.{name}"]
                        if not torch.allclose(p.grad, want, rtol=1e-10, atol=1e-12):
                            failures.append(f"{schedule} step {step}: grad {s}.{name} differs")
            rounds = pipe._agreement.rounds  # every count seen: none is agreed on again
            for step, count in enumerate(COUNTS[schedule]):
                pipe.step(*_batch(step, count), num_microbatches=count)
            if pipe._agreement.rounds != rounds:
                failures.append(f"{schedule}: known counts agreed again")
            x, _ = _batch(99, 4)
            out = pipe.eval_step(x)
            if pipe.num_microbatches != 4:
                failures.append(f"{schedule}: eval ran {pipe.num_microbatches} micro-batches")
            if out is not None:
                with torch.no_grad():
                    for s, m in mine.items():
                        ref[s].load_state_dict(m.state_dict())
                    if not torch.allclose(out, ref(x), rtol=1e-12, atol=1e-12):
                        failures.append(f"{schedule}: eval outputs differ")
    return failures


def _names(mine: dict[int, nn.Module]) -> list[str]:
    return [f"{s}.{name}" for s, m in mine.items() for name, _ in m.named_parameters()]


def run_refusals(rank: int, world_size: int) -> list[str]:
    """What cannot vary is refused on every rank, at once, naming the fix: a count the schedule
    refuses (DualPipeV's < 2 × ranks); ranks that were given different counts."""
    found = []
    stages = _stages(4)
    with Pipeline(stages, "dualpipev", 4, token_loss, device="cpu") as pipe:
        x, y = _batch(0, 3)
        try:
            pipe.step(x, y, num_microbatches=3)
        except ValueError as e:
            found.append(f"dualpipev: {e}")
    with Pipeline(_stages(2), "1f1b", 2, token_loss, device="cpu") as pipe:
        count = 4 + 4 * rank  # rank 0: 4, rank 1: 8 micro-batches of the same batch
        x, y = _batch(0, 4)
        try:
            pipe.step(x, y, num_microbatches=count)
        except ValueError as e:
            found.append(f"mismatch: {e}")
    return found
