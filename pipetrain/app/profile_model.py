"""``pipetrain profile``: measure a model's layers and write a costs file.

The model is any ``pipetrain train`` builds (``app.catalog``, the same flags): the
built-in GPT as ``[embed, block0, ..., head]`` or a Hugging Face Llama-family model as
``pipetrain.hf.causal_lm_layers`` gives it (``[model.embed_tokens, model.layers.0, ...,
model.norm, lm_head]``). The embedding and the head are layers of their own, so the planner sees
how heavy they are and can give their stages fewer blocks; the last layer is measured with the
model's loss. The costs file goes to ``--out`` or, without it, to standard output, so

    pipetrain profile --model llama > costs.json
    pipetrain plan --costs costs.json --ranks 2 --memory-gib 1 --json > plan.json
    pipetrain train --model llama --plan plan.json

profiles, plans and runs the same model (``pipetrain train --plan`` checks the layer count).
``gpt_layers`` and ``gpt_stage`` build the built-in GPT's layers and a plan's stages of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only when a model is built: the CLI's --help stays fast
    from pipetrain.app.models.gpt import GPTConfig, GPTStage


def gpt_layers(cfg: GPTConfig, seed: int = 0) -> list[GPTStage]:
    """The built-in GPT as a chain: embedding, each block, head."""
    from pipetrain.app.models.gpt import gpt_layer

    return [gpt_layer(cfg, i, seed) for i in range(cfg.num_layers + 2)]


def gpt_stage(cfg: GPTConfig, stage_layers: Sequence[int], stage: int, seed: int = 0) -> GPTStage:
    """Stage ``stage`` of the cut ``stage_layers`` of ``gpt_layers`` (counts per stage)."""
    if sum(stage_layers) != cfg.num_layers + 2 or min(stage_layers) < 1:
        raise ValueError(
            f"stage_layers {list(stage_layers)} must be counts >= 1 summing to "
            f"{cfg.num_layers + 2} (embedding, {cfg.num_layers} blocks, head)"
        )
    from pipetrain.app.models.gpt import GPTStage

    ends = list(accumulate(stage_layers))
    first, end = ends[stage] - stage_layers[stage], ends[stage]
    # list positions 1..L are blocks 0..L-1; position 0 the embedding, L+1 the head
    blocks = (max(first, 1) - 1, min(end, cfg.num_layers + 1) - 1)
    return GPTStage(
        cfg, blocks[0], blocks[1], embed=first == 0, head=end == cfg.num_layers + 2, seed=seed
    )


def add_profile_arguments(p: argparse.ArgumentParser) -> None:
    from pipetrain.app.options import MODEL_OPTIONS, add_options

    p.add_argument(
        "--out", metavar="FILE", help="where to write the costs file (default: standard output)"
    )
    add_options(p, MODEL_OPTIONS)
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "adam", "sgd-momentum", "sgd", "none"),
        help="whose state counts as static memory (default adamw)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per layer (median)")
    p.add_argument(
        "--context",
        type=int,
        default=4,
        metavar="N",
        help="layers per window timed as one stage to scale the lone times (1: none; default 4)",
    )


def run_profile(args: argparse.Namespace) -> int:
    import torch

    from pipetrain.app.catalog import build
    from pipetrain.app.options import model_shape
    from pipetrain.runtime.profile_layers import profile

    if args.repeats < 1 or args.context < 1:
        raise ValueError(
            f"--repeats and --context must be >= 1, got {args.repeats}, {args.context}"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no GPU is visible; use --device cpu")
    shape = model_shape(args)
    model = build(shape)
    layers = [m.to(device) for m in model.layer_list()]
    gen = torch.Generator().manual_seed(0)
    size = (args.microbatch_size, args.seq_len)
    tokens = torch.randint(0, args.vocab, size, generator=gen).to(device)
    inputs, targets = model.batch(tokens, torch.randint(0, args.vocab, size, generator=gen))
    costs = profile(
        layers,
        inputs,
        loss_fn=model.loss_fn,
        target=targets.to(device),
        optimizer=args.optimizer,
        repeats=args.repeats,
        context=args.context,
        names=model.names,
        path=args.out,
        meta={
            "model": args.model,
            "shape": dataclasses.asdict(shape),
            "micro_batch_size": args.microbatch_size,
        },
    )
    total = sum(layer.forward + layer.backward for layer in costs.layers)
    if args.out is None:
        print(json.dumps(costs.to_json(), indent=1))
    print(
        f"profiled {costs.num_layers} layers of {args.model} on {costs.meta['device']}: "
        f"{total:.3f} ms forward+backward per micro-batch; wrote {args.out or 'standard output'}",
        file=sys.stderr if args.out is None else sys.stdout,
    )
    return 0
