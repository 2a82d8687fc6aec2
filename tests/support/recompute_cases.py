"""Per-rank runner for ``test_runtime_recompute``: ``Pipeline.from_plan`` with per-stage
recompute against the same plan without, in float64 on gloo (the built-in GPT from a layer
factory; the Hugging Face Llama from a mapping when transformers is installed), and the plans
the runtime refuses."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

#: (label, schedule, stages per rank, micro-batches, stage_layers, recompute, defer_weight_grads)
PLANS = [
    ("1f1b", "1f1b", 1, 2, [3, 2], ["full", "selective"], None),
    ("zbv deferred", "zbv", 2, 4, [2, 1, 1, 1], ["full", "selective", "none", "full"], True),
    ("zbv replayed", "zbv", 2, 4, [1, 2, 1, 1], ["full", "selective", "full", "selective"], False),
    ("1f1b first layers", "1f1b", 1, 2, [3, 2], ["full:2", "selective:1"], True),
    ("zbv whole", "zbv", 2, 4, [2, 1, 1, 1], ["whole", "full", "none", "whole"], None),
]


def run_recompute_plans(rank: int, world: int) -> dict:
    """Per model and plan: the largest relative difference of the loss and of every gradient
    from the plan run without recompute, and whether the state-dict keys are the same; then the
    refusals."""
    from pipetrain.app.catalog import build

    out: dict = {"differences": {}, "same_keys": {}, "recomputed": {}}
    tokens, targets = _tokens()
    for model, shape in _shapes():
        for label, schedule, v, m, cut, recompute, defer in PLANS:
            cut = [*cut[:-1], cut[-1] + len(build(shape).names) - sum(cut)]  # the rest: last
            plain = {"schedule": schedule, "ranks": world, "stages_per_rank": v,
                     "microbatches": m, "stage_layers": cut}  # fmt: skip
            runs = [_run(build(shape), p, tokens, targets, defer)
                    for p in (plain, {**plain, "recompute": recompute})]  # fmt: skip
            (loss0, grads0, keys0, _), (loss1, grads1, keys1, wrapped) = runs
            worst = abs(loss1 - loss0) / abs(loss0)
            for name, g in grads0.items():
                worst = max(worst, float((grads1[name] - g).abs().max() / g.abs().max()))
            key = f"{model} {label}"
            out["differences"][key] = worst
            out["same_keys"][key] = keys0 == keys1 and grads0.keys() == grads1.keys()
            out["recomputed"][key] = wrapped
    out["refusals"] = _refusals(world)
    return out


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (8, 8), generator=torch.Generator().manual_seed(1))
    return tokens, torch.roll(tokens, -1, dims=1)


def _shapes() -> list:
    """(name, shape) of the built-in GPT and, where transformers is installed, the Hugging Face
    Llama (with its side inputs: position ids, mask), tiny and in float64."""
    from pipetrain.app.catalog import ModelShape

    models = ["gpt"]
    try:
        import transformers  # noqa: F401

        models.append("llama")
    except ImportError:
        pass
    return [
        (
            name,
            ModelShape(
                model=name,
                blocks=3,
                hidden=16,
                heads=4,
                kv_heads=2 if name == "llama" else None,
                vocab=256,
                seq_len=8,
                dtype="float64",
                seed=5,
            ),
        )
        for name in models
    ]


def _run(model, plan: dict, tokens, targets, defer):
    from pipetrain.runtime.backward.activation_checkpoint import Recomputed
    from pipetrain.runtime.pipeline import Pipeline

    pipe = Pipeline.from_plan(
        model.layers, plan, loss_fn=model.loss_fn, device="cpu", defer_weight_grads=defer
    )
    loss = float(pipe.step(*model.batch(tokens, targets)))
    grads = {
        n: p.grad.clone()
        for s in pipe.modules.values()
        for n, p in s.named_parameters()
        if p.grad is not None
    }
    keys = sorted(k for s in pipe.modules.values() for k in s.state_dict())
    # per local stage, the mode each of its layers runs under
    wrapped = {
        s: ["whole"] * len(st.chain)  # one region, no layer wrapped
        if st.recompute_whole
        else [layer.mode if isinstance(layer, Recomputed) else "none" for layer, _ in st.chain]
        for s, st in pipe.modules.items()
    }
    pipe.close()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (grads, keys, wrapped))
    all_grads = {n: g for part, _, _ in gathered for n, g in part.items()}
    all_keys = sorted(k for _, part, _ in gathered for k in part)
    all_wrapped = {s: m for _, _, part in gathered for s, m in part.items()}
    return loss, all_grads, all_keys, all_wrapped


def _refusals(world: int) -> dict:
    from torch import nn

    from pipetrain.runtime.pipeline import Pipeline

    layers = {"lin": nn.Linear(4, 4), "act": nn.ReLU()}
    base = {"schedule": "1f1b", "ranks": world, "stages_per_rank": 1, "microbatches": 2,
            "stage_layers": [1, 1]}  # fmt: skip
    cases = {
        "no parameters": {**base, "recompute": ["none", "full"]},
        "offload": {**base, "offload": [0.0, 0.5]},
        "mode": {**base, "recompute": ["none", "everything"]},
    }
    out = {}
    for label, plan in cases.items():
        try:
            Pipeline.from_plan(layers, plan, loss_fn=lambda y, t: y.sum())
            out[label] = ""
        except ValueError as e:
            out[label] = str(e)
    return out


#: (label, schedule, stages per rank, micro-batches, cut, stages recomputed as a whole, defer)
WHOLE_PLANS = [
    ("1f1b", "1f1b", 1, 3, [3, 2], [0, 1], None),
    ("zbv deferred", "zbv", 2, 4, [2, 1, 1, 1], [0, 1, 3], True),
    ("zbv replayed", "zbv", 2, 4, [1, 2, 1, 1], [1, 2, 3], False),
    ("interleaved-zb", "interleaved-zb", 2, 4, [2, 1, 1, 1], [0, 2], None),
    ("dualpipev", "dualpipev", 2, 4, [1, 1, 2, 1], [0, 1, 2, 3], None),
]


def run_whole_stage_plans(rank: int, world: int) -> dict:
    """Per plan: the largest relative difference of the loss and of every gradient from the same
    plan without recompute, for the GPT (float64) and for a stack with dropout (the recompute
    must draw the forward's masks again); then what is refused."""
    from pipetrain.app.catalog import build

    out: dict = {"differences": {}, "refusals": {}}
    tokens, targets = _tokens()
    shapes = _shapes()
    for name, shape in shapes:
        for label, schedule, v, m, cut, whole, defer in WHOLE_PLANS:
            model = build(shape)
            cut = [*cut[:-1], cut[-1] + len(model.names) - sum(cut)]
            batch = model.batch(tokens, targets)
            runs = [
                _run_whole(
                    lambda shape=shape: _layers(build(shape)),
                    model.loss_fn,
                    batch,
                    schedule,
                    v,
                    m,
                    cut,
                    marked,
                    defer,
                )
                for marked in ([], whole)
            ]
            out["differences"][f"{name} {label}"] = _worst(*runs)
    if (
        len(shapes) > 1
    ):  # the Llama, its embedding tied to the head, both stages recomputed as a whole
        shape = dataclasses.replace(shapes[1][1], tie_embeddings=True)
        for schedule, v, cut, whole in (
            ("1f1b", 1, [3, 3], [0, 1]),
            ("zbv", 2, [2, 1, 1, 2], [0, 3]),
        ):
            model = build(shape)
            batch = model.batch(tokens, targets)
            runs = [
                _run_whole(
                    lambda: _layers(build(shape)),
                    model.loss_fn,
                    batch,
                    schedule,
                    v,
                    4,
                    cut,
                    marked,
                    None,
                    model.tied,
                )
                for marked in ([], whole)
            ]
            out["differences"][f"llama tied {schedule}"] = _worst(*runs)
    dropout = lambda: [  # noqa: E731
        torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Dropout(0.5)).double() for _ in range(4)
    ]
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    runs = []
    for marked in ([], [0, 1]):
        torch.manual_seed(11)  # the same stream for both: the masks must come out the same
        runs.append(_run_whole(lambda: _seeded(dropout), _mse, (x, x), "1f1b", 1, 4, [2, 2],
                               marked, None))  # fmt: skip
    out["differences"]["dropout 1f1b"] = _worst(*runs)
    out["refusals"] = _whole_refusals()
    return out


def _layers(model):
    """The catalog model's layers as ``split`` takes them: a list where ``layers`` is a factory
    ``index -> layer`` (the GPT), else as given (a mapping: the Llama)."""
    layers = model.layers
    if isinstance(layers, dict) or not callable(layers):
        return layers
    return [layers(i) for i in range(len(model.names))]


def _seeded(make):
    torch.manual_seed(3)  # the same weights in both runs
    return make()


def _mse(y, t):
    return ((y - t) ** 2).mean()


def _worst(run0, run1) -> float:
    (loss0, grads0), (loss1, grads1) = run0, run1
    assert grads0.keys() == grads1.keys(), (sorted(grads0), sorted(grads1))
    worst = abs(loss1 - loss0) / abs(loss0)
    for name, g in grads0.items():
        worst = max(worst, float((grads1[name] - g).abs().max() / g.abs().max()))
    return worst


def _run_whole(layers, loss_fn, batch, schedule, v, m, cut, marked, defer, tied=()):
    from pipetrain.runtime.backward.activation_checkpoint import recompute_stage
    from pipetrain.runtime.layers import split
    from pipetrain.runtime.pipeline import Pipeline

    stages = split(layers(), cut)
    for s in marked:
        recompute_stage(stages[s], "whole", s)
    with Pipeline(lambda s: stages[s], schedule, m, loss_fn, stages_per_rank=v,
                  num_stages=len(cut), device="cpu", defer_weight_grads=defer,
                  tied=tied) as pipe:  # fmt: skip
        loss = float(pipe.step(*batch))
        grads = {
            f"{s}.{n}": p.grad.clone()
            for s, st in pipe.modules.items()
            for n, p in st.named_parameters()
            if p.grad is not None
        }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, grads)
    return loss, {n: g for part in gathered for n, g in part.items()}


def _whole_refusals() -> dict:
    from pipetrain.runtime.backward.activation_checkpoint import recompute_stage
    from pipetrain.runtime.layers import split

    out = {}
    stage = split([torch.nn.Linear(4, 4), torch.nn.ReLU()], [1, 1])[1]
    try:
        recompute_stage(stage, "whole", 1)
    except ValueError as e:
        out["no parameters"] = str(e)
    stage = split([torch.nn.Linear(4, 4)], [1])[0]
    recompute_stage(stage, "full", 0)
    try:
        recompute_stage(stage, "whole", 0)
    except ValueError as e:
        out["twice"] = str(e)
    return out
