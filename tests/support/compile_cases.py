"""Compiled blocks and torchao float8 linears inside stages (run inside spawned processes).

Each case builds the app's GPT in float64 as pipeline stages, converts the block linears to
torchao's float8 training linears (emulated: the CPU has no float8 GEMM; the casts, scales and
rounding are float8's) and/or compiles every block on its own, and trains two steps. The
reference is the same model unsplit, converted alike, accumulating gradients over the same
micro-batches: float8 scales are per tensor per call, so only the same micro-batches give the
same scales, and then the results agree to round-off.
"""

from __future__ import annotations

import torch

from pipetrain.app.models.gpt import GPTConfig, build_gpt, lm_loss, make_stage

CFG = GPTConfig(vocab_size=32, seq_len=16, num_layers=4, hidden=32, num_heads=2)
ROWS = 2  # per micro-batch


def convert(module: torch.nn.Module, float8: bool, backend: str | None) -> torch.nn.Module:
    module = module.double()
    if float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            module,
            config=Float8LinearConfig(emulate=True),
            module_filter_fn=lambda _, fqn: ".blocks." in f".{fqn}",
        )
    if backend is not None:
        for block in module.blocks.values():
            block.compile(backend=backend)
    return module


def batch(m: int):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, CFG.vocab_size, (m * ROWS, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab_size, (m * ROWS, CFG.seq_len), generator=g)
    return x, y


def reference(m: int, float8: bool, steps: int):
    """Loss and gradients (by parameter name) of the unsplit model over the same micro-batches."""
    model = convert(build_gpt(CFG), float8, None)
    x, y = batch(m)
    loss = torch.zeros((), dtype=torch.float64)
    for _ in range(steps):
        loss = torch.zeros((), dtype=torch.float64)
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            part = lm_loss(model(xs), ys) / m
            part.backward()
            loss += part.detach()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def run_cases(rank: int, world: int, cases: list[tuple[str, bool | None, bool, str]]) -> list[str]:
    """Each (schedule, defer_weight_grads, float8, backend): two steps against the reference;
    returns the differences found."""
    import pipetrain
    from pipetrain.schedule.registry import build_schedule, family

    found: list[str] = []
    for name, defer, float8, backend in cases:
        v = family(name).default_stages_per_rank
        num_stages = v * world
        m = next(k for k in range(1, 4 * world + 1) if _legal(build_schedule, name, world, k))
        stages: dict[int, torch.nn.Module] = {}

        def build(s: int, float8=float8, backend=backend, num_stages=num_stages, stages=stages):
            stages[s] = convert(make_stage(CFG, s, num_stages), float8, backend)
            return stages[s]

        pipe = pipetrain.Pipeline(
            build,
            name,
            m,
            lm_loss,
            stages_per_rank=v,
            num_stages=num_stages,
            defer_weight_grads=defer,
        )
        x, y = batch(m)
        losses = [pipe.step(x, y) for _ in range(2)]
        ref_loss, ref_grads = reference(m, float8, steps=2)
        case = f"{name} defer={defer} float8={float8} backend={backend}"
        for i, loss in enumerate(losses):
            if not torch.allclose(loss, ref_loss, rtol=1e-10, atol=0):
                found.append(f"{case}: step {i} loss {loss.item()} != {ref_loss.item()}")
        for s, module in stages.items():
            for n, p in module.named_parameters():
                want = ref_grads[n]  # the GPT names its blocks globally
                if p.grad is None or not torch.allclose(p.grad, want, rtol=1e-9, atol=1e-13):
                    found.append(f"{case}: stage {s} {n} gradient differs")
        pipe.close()
    return found


def _legal(build_schedule, name: str, world: int, m: int) -> bool:
    try:
        build_schedule(name, world, m)
    except ValueError:
        return False
    return True
