"""``pipetrain profile``: measure a model's layers and write a costs file.

The model is any ``pipetrain train`` builds (``app.catalog``, the same model flags): the
built-in GPT as ``[embed, block0, ..., head]`` or a Hugging Face Llama-family model as
``pipetrain.hf.causal_lm_layers`` gives it (``[model.embed_tokens, model.layers.0, ...,
model.norm, lm_head]``). The embedding and the head are layers of their own, so the planner sees
how heavy they are and can give their stages fewer blocks; the last layer is measured with the
model's loss (``runtime.profile_layers``). The costs file goes to ``--out`` or, without it, to
standard output, so

    pipetrain profile --model llama > costs.json
    pipetrain plan --costs costs.json --ranks 2 --memory-gib 1 --json > plan.json
    pipetrain train --model llama --plan plan.json

profiles, plans and runs the same model (``pipetrain train --plan`` checks the layer count).
For a run replayed as a CUDA graph (``train --cuda-graph``) profile with ``--timing device``: the
layers' device time alone, without the host time an eager step waits for.
torch is imported when the command runs, not when its parser is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from pipetrain.cli.flags import Command, Option, model_options, model_shape, require_torch
from pipetrain.planner.costs_file import ModelCosts

OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "sgd", "none")
#: the profiler's clocks (``runtime.profile_clock.TIMINGS``; the parser imports no torch)
TIMINGS = ("wall", "device")


def options() -> tuple[Option, ...]:
    return (
        Option(
            ("--out",),
            metavar="FILE",
            help="where to write the costs file (default: standard output)",
        ),
        *model_options(),
        Option(
            ("--optimizer",),
            default="adamw",
            choices=OPTIMIZERS,
            help="whose state counts as static memory",
        ),
        Option(("--device",), help="cpu or cuda (default: cuda if available)"),
        Option(
            ("--repeats",),
            type=int,
            default=5,
            help="timed runs per layer (median)",
            shown_default="",
        ),
        Option(
            ("--context",),
            type=int,
            default=4,
            metavar="N",
            help="layers per window timed as one stage to scale the lone times (1: none; "
            "default 4)",
            shown_default="",
        ),
        Option(
            ("--timing",),
            default="wall",
            choices=TIMINGS,
            help="wall: what an eager step pays, host waits included; device: the GPU's busy "
            "time and a replay's gap per kernel, what a step replayed as a CUDA graph pays "
            "(train --cuda-graph)",
        ),
    )


def run(args: argparse.Namespace) -> int:
    require_torch()
    import torch

    from pipetrain.app.catalog import build
    from pipetrain.runtime.profile_layers import profile

    if args.repeats < 1 or args.context < 1:
        raise ValueError(
            f"--repeats and --context must be >= 1, got {args.repeats}, {args.context}"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no GPU is visible; use --device cpu")
    if args.timing == "device" and device.type != "cuda":
        raise ValueError("--timing device reads a GPU's busy time; on a CPU use --timing wall")
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
        timing=args.timing,
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
    if "replay_gap_us" in costs.meta:  # what the device clock adds per kernel, and measured on
        slower = costs.meta.get("sustained_slowdown", 1.0)
        print(
            f"device clock: busy time plus {costs.meta['replay_gap_us']:.2f} µs a kernel, times "
            f"{slower:.3f} for sustained load; the replay's gap and slowdown measured on "
            f"{costs.meta['replay_gap_on']}",
            file=sys.stderr if args.out is None else sys.stdout,
        )
    if costs.has_issue_times:  # an eager GPU profile: the host model's two halves
        print(issue_line(costs), file=sys.stderr if args.out is None else sys.stdout)
    return 0


def issue_line(costs: ModelCosts) -> str:
    """The host's and the device's forward+backward per micro-batch, summed over the layers:
    which of the two an eager step of the whole model waits for."""
    host = sum((x.host_forward or 0.0) + (x.host_backward or 0.0) for x in costs.layers)
    device = sum((x.device_forward or 0.0) + (x.device_backward or 0.0) for x in costs.layers)
    bound = "host-bound" if host > device else "device-bound"
    slower = costs.meta.get("sustained_slowdown", 1.0)
    return (
        f"eager host model: host {host:.3f} ms, device {device:.3f} ms forward+backward per "
        f"micro-batch ({bound} over the whole model; device times {slower:.3f} x for sustained "
        "load); plan eager steps with the runtime's own host time per action "
        "(pipetrain plan --host-action-ms, from a train run's host: line)"
    )


COMMAND = Command(
    name="profile",
    help="measure a model's layers into a costs file",
    options=options,
    run=run,
)
