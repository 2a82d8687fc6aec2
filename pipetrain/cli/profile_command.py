"""``pipetrain profile``: measure a model's layers and write a costs file.

The model is any ``pipetrain train`` builds (``app.catalog``, the same model flags): the
built-in GPT as ``[embed, block0, ..., head]`` or a Hugging Face Llama-family model as
``pipetrain.hf.causal_lm_layers`` gives it (``[model.embed_tokens, model.layers.0, ...,
model.norm, lm_head]``). The embedding and the head are layers of their own, so the planner sees
how heavy they are and can give their stages fewer blocks; the last layer is measured with the
model's loss (``runtime.profile.profile_layers``). The costs file goes to ``--out`` or, without it, to
standard output, so

    pipetrain profile --model llama > costs.json
    pipetrain plan --costs costs.json --ranks 2 --memory-gib 1 --json > plan.json
    pipetrain train --model llama --plan plan.json

profiles, plans and runs the same model (``pipetrain train --plan`` checks the layer count).
For a run replayed as a CUDA graph (``train --cuda-graph``) profile with ``--timing device``: the
layers' device time alone, without the host time an eager step waits for.

``--model-dir DIR`` profiles a local Hugging Face folder's own layers (its weights, loaded with
``pipetrain.hf.from_pretrained`` one layer to a stage) instead of a built model, checked as
``pipetrain train --model-dir`` checks it (``app.model_folder``). ``--seq-lens N1,N2,...``
profiles the model at each sequence length (and at ``--seq-len``, whose times the file keeps)
and fits each layer's ``per_token`` and ``per_token_sq`` (``planner.varlen.with_length_costs``):
what a packed document of ``n`` tokens costs, attention's ``n²`` included, for balancing packed
micro-batches. ``--tp 1,2,4,8`` adds each layer at each tensor-parallel degree above 1 (costs file
version 3): measured on a group of that many worker processes where the machine runs one
(``runtime.profile.profile_tp_measured``: on a GPU node with the GPUs, or on a CPU with
``--tp-measure processes``), else derived from the layer's degree-1 measurements, its matrix
products timed alone and its collectives' bytes priced at ``--link-gbs``
(``runtime.profile.profile_tp``); each entry marked so (``cli.profile_tp_choice`` decides).
``--ep E`` on a mixture-of-experts folder adds each MoE layer's dispatched bytes and the expert
link's GB/s, measured on a group of E processes (the real, uneven dispatch of the sharded
experts, and an all-to-all timed at its size) or derived, as ``cli.profile_ep_choice`` decides.
torch is imported when the command runs, not when its parser is built.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipetrain.cli.flags import (
    Command,
    Option,
    int_list,
    model_options,
    require_torch,
)
from pipetrain.cli.profile_ep_choice import ep_choice, ep_line, expert_options
from pipetrain.cli.profile_models import BuiltModel, FolderModel, sample_batch
from pipetrain.cli.profile_tp_choice import TpChoice, tp_choice, tp_line, tp_options
from pipetrain.planner.costs_file import ModelCosts, save_costs
from pipetrain.planner.varlen import with_length_costs

OPTIMIZERS = ("adamw", "adam", "sgd-momentum", "sgd", "none")
#: the profiler's clocks (``runtime.profile.profile_clock.TIMINGS``; the parser imports no torch)
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
            ("--model-dir",),
            metavar="DIR",
            help="profile the Hugging Face model in DIR (config.json, safetensors files; Llama "
            "family, GPT-2, or the mixture-of-experts Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS) "
            "with its own weights instead of building one: the model flags "
            "other than --seq-len, --dtype and --microbatch-size do not apply",
        ),
        Option(
            ("--seq-lens",),
            type=int_list,
            metavar="N1,N2,...",
            help="also profile at these sequence lengths and fit each layer's per_token and "
            "per_token_sq (time ~ n and n², attention's cost) into the costs file; the times "
            "stay --seq-len's",
        ),
        *tp_options(),
        *expert_options(),
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
    from pipetrain.app.launch import quiet_import_notices

    quiet_import_notices()
    import torch

    if args.repeats < 1 or args.context < 1:
        raise ValueError(
            f"--repeats and --context must be >= 1, got {args.repeats}, {args.context}"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but no GPU is visible; use --device cpu")
    if args.timing == "device" and device.type != "cuda":
        raise ValueError("--timing device reads a GPU's busy time; on a CPU use --timing wall")
    lengths = sorted({args.seq_len, *(args.seq_lens or ())})
    if args.seq_lens is not None and len(lengths) < 2:
        raise ValueError(
            f"--seq-lens {','.join(map(str, args.seq_lens))}: fitting needs two or more "
            f"distinct lengths besides --seq-len {args.seq_len}"
        )
    model = FolderModel(args, max(lengths)) if args.model_dir else BuiltModel(args)
    tp = tp_choice(args, model, device)  # refused before anything is timed
    ep = ep_choice(args, model, device)
    by_length = {n: _profile_at(args, model, n, device, tp) for n in lengths}
    costs = by_length[args.seq_len]
    if args.seq_lens is not None:
        costs = with_length_costs(by_length, at=args.seq_len, rows=args.microbatch_size)
    if ep is not None:
        costs = ep.apply(args, model, costs, device)
    if args.out is not None:
        save_costs(costs, args.out)
    _report(args, costs, model.label)
    return 0


def _profile_at(
    args: argparse.Namespace, model: Any, seq_len: int, device: Any, tp: TpChoice
) -> ModelCosts:
    """The model's layers profiled on micro-batches of ``seq_len`` random tokens; at
    ``--seq-len`` with each ``--tp`` degree above 1, measured or derived as ``tp`` says."""
    from pipetrain.runtime.profile.profile_layers import profile

    layers, loss_fn, batch, vocab, meta = model.at(seq_len)
    layers = [m.to(device) for m in layers]
    inputs, targets = sample_batch(args, batch, vocab, seq_len, device)
    costs = profile(
        layers,
        inputs,
        loss_fn=loss_fn,
        target=targets,
        optimizer=args.optimizer,
        repeats=args.repeats,
        context=args.context,
        names=model.names,
        timing=args.timing,
        meta={**meta, "micro_batch_size": args.microbatch_size, "seq_len": seq_len},
    )
    if seq_len != args.seq_len or max(args.tp) == 1:
        return costs
    from pipetrain.runtime.profile.profile_tp import with_tp

    measured = tp.measure(args, seq_len, device, len(layers))
    sample = inputs if isinstance(inputs, tuple) else (inputs,)
    costs = with_tp(
        costs, layers, sample, args.tp, tp.link_gbs, repeats=args.repeats, measured=measured
    )
    return tp.annotate(costs)


def _report(args: argparse.Namespace, costs: ModelCosts, label: str) -> None:
    """The costs file on standard output without ``--out``; a summary line (standard error
    then)."""
    where = sys.stderr if args.out is None else sys.stdout
    if args.out is None:
        print(json.dumps(costs.to_json(), indent=1))
    total = sum(layer.forward + layer.backward for layer in costs.layers)
    print(
        f"profiled {costs.num_layers} layers of {label} on {costs.meta['device']}: "
        f"{total:.3f} ms forward+backward per micro-batch; wrote {args.out or 'standard output'}",
        file=where,
    )
    if "length_cost" in costs.meta:
        per_token = sum(x.per_token or 0.0 for x in costs.layers)
        per_token_sq = sum(x.per_token_sq or 0.0 for x in costs.layers)
        fitted = ",".join(map(str, costs.meta["length_cost"]["seq_lens"]))
        print(
            f"length cost per row: {per_token:.3g} ms per token + {per_token_sq:.3g} ms per "
            f"token² (fitted over sequence lengths {fitted})",
            file=where,
        )
    for line in (ep_line(costs), tp_line(costs)):
        if line is not None:
            print(line, file=where)
    if "replay_gap_us" in costs.meta:  # what the device clock adds per kernel, and measured on
        slower = costs.meta.get("sustained_slowdown", 1.0)
        print(
            f"device clock: busy time plus {costs.meta['replay_gap_us']:.2f} µs a kernel, times "
            f"{slower:.3f} for sustained load; the replay's gap and slowdown measured on "
            f"{costs.meta['replay_gap_on']}",
            file=where,
        )
    if costs.has_issue_times:  # an eager GPU profile: the host model's two halves
        print(issue_line(costs), file=where)


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
