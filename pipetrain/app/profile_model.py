"""``pipetrain profile``: measure the built-in GPT's layers and write a costs file.

The GPT as a layer list is ``[embedding, block 0, ..., block L-1, head]`` (``gpt_layers``): the
embedding and the head (with the final LayerNorm and, when profiling, the loss) are layers of
their own, so the planner sees how heavy they are and can give their stages fewer blocks.
``gpt_stage`` builds the stage a plan's ``stage_layers`` cut from that list, with the same weights
the unsplit model has (``GPTStage`` seeds every part by its layer).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from itertools import accumulate
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only when a model is built: the CLI's --help stays fast
    from pipetrain.app.models.gpt import GPTConfig, GPTStage


def gpt_layers(cfg: GPTConfig, seed: int = 0) -> list[GPTStage]:
    """The model as a chain: embedding, each block, head."""
    from pipetrain.app.models.gpt import GPTStage

    n = cfg.num_layers
    return [
        GPTStage(cfg, 0, 0, embed=True, head=False, seed=seed),
        *(GPTStage(cfg, i, i + 1, embed=False, head=False, seed=seed) for i in range(n)),
        GPTStage(cfg, n, n, embed=False, head=True, seed=seed),
    ]


def gpt_layer_names(cfg: GPTConfig) -> list[str]:
    return ["embed", *(f"block{i}" for i in range(cfg.num_layers)), "head"]


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
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the costs file")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks (default 8)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default 256)")
    p.add_argument("--seq-len", type=int, default=64, help="sequence length (default 64)")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "adam", "sgd-momentum", "sgd", "none"),
        help="whose state counts as static memory (default adamw)",
    )
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per layer (median)")


def run_profile(args: argparse.Namespace) -> int:
    import torch

    from pipetrain.app.models.gpt import GPTConfig, lm_loss
    from pipetrain.runtime.profile_layers import profile

    for name in ("layers", "hidden", "heads", "vocab", "seq_len", "micro_batch_size", "repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no GPU is visible; use --device cpu")
    cfg = GPTConfig(
        vocab_size=args.vocab,
        seq_len=args.seq_len,
        num_layers=args.layers,
        hidden=args.hidden,
        num_heads=args.heads,
    )
    layers = [m.to(device) for m in gpt_layers(cfg)]
    gen = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq_len)
    tokens = torch.randint(0, cfg.vocab_size, shape, generator=gen).to(device)
    targets = torch.randint(0, cfg.vocab_size, shape, generator=gen).to(device)
    costs = profile(
        layers,
        tokens,
        loss_fn=lm_loss,
        target=targets,
        optimizer=args.optimizer,
        repeats=args.repeats,
        names=gpt_layer_names(cfg),
        path=args.out,
        meta={"model": "gpt", "config": vars(cfg), "micro_batch_size": args.micro_batch_size},
    )
    total = sum(layer.forward + layer.backward for layer in costs.layers)
    print(
        f"profiled {costs.num_layers} layers on {costs.meta['device']}: "
        f"{total:.3f} ms forward+backward per micro-batch; wrote {args.out}"
    )
    return 0
