"""``Pipeline(precompile=True)`` on the app's GPT in float64 (run inside spawned processes).

Every block is compiled with a backend that notes each forward and backward graph it compiles
(``aot_autograd`` compiles a backward when the backward first runs), so a case can tell what
the probe and stand-in passes compiled from what the step's own actions compiled.
"""

from __future__ import annotations

import torch

from pipetrain.app.models.gpt import lm_loss, make_stage
from tests.support.compile_cases import CFG, batch, convert, reference


def counting_backend(compiled: list[str]):
    """``aot_eager`` that appends ``"forward"`` / ``"backward"`` to ``compiled`` per graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def note(kind: str):
        def compiler(gm, example_inputs):
            compiled.append(kind)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=note("forward"), bw_compiler=note("backward"))


def note_ahead(pipe, compiled: list[str]) -> list[int]:
    """After each run of ``pipe``'s probe and passes, how many graphs ``compiled`` then held."""
    ahead: list[int] = []
    before_step = pipe._precompile.before_step

    def noting(*args) -> None:
        before_step(*args)
        ahead.append(len(compiled))

    pipe._precompile.before_step = noting
    return ahead


def precompiled(rank: int, world: int, schedules: list[str]) -> list[str]:
    """Per schedule: two steps with ``precompile=True``; returns what went wrong — a graph the
    step compiled itself, nothing compiled ahead, or a loss or gradient unlike the unsplit
    model's (which the stand-in passes would change had they left a trace)."""
    import pipetrain
    from pipetrain.schedule.registry import family

    found: list[str] = []
    for name in schedules:
        torch._dynamo.reset()
        compiled: list[str] = []
        v = family(name).default_stages_per_rank
        stages: dict[int, torch.nn.Module] = {}

        def build(s: int, v=v, stages=stages, compiled=compiled):
            stages[s] = convert(make_stage(CFG, s, v * world), False, None)
            for block in stages[s].blocks.values():
                block.compile(backend=counting_backend(compiled))
            return stages[s]

        m = 2 * world
        pipe = pipetrain.Pipeline(
            build, name, m, lm_loss, stages_per_rank=v, num_stages=v * world, precompile=True
        )
        ahead = note_ahead(pipe, compiled)
        x, y = batch(m)
        losses = [pipe.step(x, y) for _ in range(2)]
        pipe.close()
        if sorted(set(compiled[: ahead[0]])) != ["backward", "forward"]:
            found.append(f"{name}: compiled ahead {compiled[: ahead[0]]}, not forward and backward")
        if len(compiled) != ahead[0]:
            found.append(f"{name}: the steps compiled {compiled[ahead[0] :]} themselves")
        ref_loss, ref_grads = reference(m, False, steps=2)
        for i, loss in enumerate(losses):
            if not torch.allclose(loss, ref_loss, rtol=1e-10, atol=0):
                found.append(f"{name}: step {i} loss {loss.item()} != {ref_loss.item()}")
        for s, module in stages.items():
            for n, p in module.named_parameters():
                if p.grad is None or not torch.allclose(
                    p.grad, ref_grads[n], rtol=1e-9, atol=1e-13
                ):
                    found.append(f"{name}: stage {s} {n} gradient differs")
    return found


def refused(rank: int, world: int, how: str) -> str:
    """The error ``precompile=True`` meets when a stand-in pass would leave a trace (``"defer"``,
    ``"hook"``), or, for eager stages that defer (``"eager"``: only the probe runs there), the
    first step's loss against the unsplit model's."""
    import pipetrain

    def build(s: int):
        stage = convert(make_stage(CFG, s, world), False, None)
        for block in stage.blocks.values() if how != "eager" else ():
            block.compile(backend="aot_eager")
        if how == "hook":
            next(stage.parameters()).register_hook(lambda g: g)
        return stage

    defer = None if how == "hook" else True
    try:
        pipe = pipetrain.Pipeline(
            build, "1f1b", 2, lm_loss, num_stages=world, precompile=True, defer_weight_grads=defer
        )
    except ValueError as e:
        torch.distributed.barrier()  # every rank refuses on its own; rank 0 holds the store
        return f"ValueError: {e}"
    with pipe:
        loss = pipe.step(*batch(2))
    want = reference(2, False, steps=1)[0]
    return f"built: loss {'equal' if torch.allclose(loss, want, rtol=1e-10, atol=0) else loss}"


def precompiled_hf(rank: int, world: int, variant: str) -> list[str]:
    """A tiny Llama through ``pipetrain.hf``, every decoder layer compiled, padded (``"left"``)
    or packed rows as side inputs, 1F1B with ``precompile=True``: against the unsplit model, and
    which graphs the step compiled itself."""
    from hf_cases import _close, build
    from hf_mask_cases import ROWS, batch, gradient_failures, reference, side_inputs

    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_token_loss, next_token_targets

    found: list[str] = []
    ids, side = batch(ROWS), side_inputs(variant)
    targets = next_token_targets(ids, **side)
    ref_loss, ref_grads = reference("llama", 2, ids, side, targets)
    model = build("llama", 2)
    compiled: list[str] = []
    layers = causal_lm_layers(model)
    for name, layer in layers.items():
        if ".layers." in f".{name}.":
            layer.compile(backend=counting_backend(compiled))
    stages = pipetrain.split(layers, [2, 3])  # a decoder layer on each rank
    pipe = pipetrain.Pipeline(stages, "1f1b", 4, causal_lm_token_loss, precompile=True)
    ahead = note_ahead(pipe, compiled)
    with pipe:
        loss = pipe.step(ids, targets, side=side)
    if not ahead or not compiled[: ahead[0]]:
        found.append(f"{variant}: nothing compiled ahead")
    elif len(compiled) != ahead[0]:
        found.append(f"{variant}: the step compiled {compiled[ahead[0] :]} itself")
    if not _close(loss, ref_loss):
        found.append(f"{variant}: loss {loss.item()} != {ref_loss.item()}")
    return found + gradient_failures(variant, model, pipe, ref_grads)


def app_losses(
    rank: int, world: int, extra: list[str], corpus: str
) -> tuple[list[float], bool, int]:
    """``pipetrain train``'s loop (the GPT, float64, 1F1B on ``world`` ranks) with the flags
    ``extra``: the losses, whether its pipeline precompiled, and how many float8 linears this
    rank's stages hold. ``--compile`` compiles with the ``aot_eager`` backend here (dynamo and
    autograd's tracing, as inductor gets them, without its C++ builds on a 2-core machine)."""
    from pipetrain.app.train import train
    from pipetrain.runtime.pipeline import Pipeline
    from tests.support.train_cases import train_args

    made: list[Pipeline] = []
    build = Pipeline.__init__

    def tracked(self, *args, **kwargs) -> None:
        made.append(self)
        build(self, *args, **kwargs)

    Pipeline.__init__ = tracked  # type: ignore[method-assign]  # this process only
    compile_ = torch.nn.Module.compile

    def light(self, *args, **kwargs) -> None:  # aot_eager: inductor's C++ builds take minutes
        compile_(self, *args, **{**kwargs, "backend": "aot_eager"})

    torch.nn.Module.compile = light  # type: ignore[method-assign]  # this process only
    flags = ["--model", "gpt", "-p", str(world), "-m", "2", "--steps", "3", "--layers", "2"]
    flags += ["--hidden", "16", "--heads", "2", "--seq-len", "16", "--dtype", "float64"]
    flags += ["--schedule", "1f1b", "--corpus-out", corpus, "--svg", corpus + ".svg"]
    run = train(train_args(*flags, *extra), torch.device("cpu"))
    pipe = made[0]
    float8 = sum(
        type(m).__name__ == "Float8Linear" for s in pipe.modules.values() for m in s.modules()
    )
    from pipetrain.runtime.backward.deferred_wgrad import has_compiled_parts

    compiled = all(has_compiled_parts(m) for m in pipe.modules.values())
    return run.losses, pipe._precompile is not None and compiled, float8


def automatic(rank: int, world: int) -> list[bool]:
    """``precompile`` left at its default (``None``) per case — compiled stages on graph replay,
    compiled stages that defer (refused under ``True``), eager stages: whether the pipeline
    precompiles."""
    import pipetrain

    found = []
    for compiled, defer in ((True, None), (True, True), (False, None)):

        def build(s: int, compiled=compiled):
            stage = convert(make_stage(CFG, s, world), False, None)
            for block in stage.blocks.values() if compiled else ():
                block.compile(backend="aot_eager")
            return stage

        with pipetrain.Pipeline(
            build, "1f1b", 2, lm_loss, num_stages=world, defer_weight_grads=defer
        ) as pipe:
            found.append(pipe._precompile is not None)
    return found
