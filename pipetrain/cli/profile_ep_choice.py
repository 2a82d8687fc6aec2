"""``pipetrain profile --ep E``: each mixture-of-experts layer's dispatched bytes and the expert
link's GB/s, measured on a real group of E processes or derived (``--ep-measure``), decided
before anything is timed, and the report's line saying which.

Measured (``runtime.profile.profile_ep_measured``) where the machine runs E ranks: on a GPU node
with E GPUs visible (``auto`` and ``processes``); on a CPU only when asked (``processes``): E
gloo processes time a CPU's loopback, which the planner of a GPU job should not take for a GPU's
link — it is how the tests exercise the measuring path. Otherwise the bytes are derived from the
config and the micro-batch, the routing taken as balanced (``planner.costs_file_moe
.dispatched_bytes``), and the link is only what ``--ep-link-gbs`` gives. A given link always wins
over a measured one; ``meta["ep"]`` says of each value whether it was measured, derived or given
(and why a measurement was not made). torch is imported when the command runs.
"""

from __future__ import annotations

import argparse
import functools
from dataclasses import dataclass
from typing import Any

from pipetrain.cli.flags import Option, positive_float, positive_int
from pipetrain.planner.costs_file import ModelCosts

#: ``--ep-measure``'s values
EP_MEASURE = ("auto", "derive", "processes")


def expert_options() -> tuple[Option, ...]:
    """``profile``'s expert-parallel flags."""
    return (
        Option(
            ("--ep",),
            type=positive_int,
            default=1,
            metavar="E",
            help="a mixture-of-experts --model-dir folder under expert parallel E: write each MoE "
            "layer's dispatched_bytes (the bytes a rank's token dispatch sends to the other "
            "ranks per micro-batch; measured or derived, as --ep-measure says) for the "
            "planner's all-to-all",
            shown_default="1",
        ),
        Option(
            ("--ep-measure",),
            default="auto",
            choices=EP_MEASURE,
            help="how --ep's numbers are had: auto measures the dispatch and the link on E GPUs "
            "where they are visible, else derives the bytes (tokens × top-k × hidden × bytes × "
            "(E-1)/E, balanced routing) with no link; derive: always so; processes: measured on "
            "E worker processes (gloo on a CPU: it times the CPU, for tests)",
        ),
        Option(
            ("--ep-link-gbs",),
            type=positive_float,
            metavar="GB/s",
            help="with --ep: the GB/s each rank sends at over the expert-parallel link, written "
            "as the costs file's ep_link_gbs (what plan and simulate price the all-to-all at); "
            "given, it wins over a measured link",
            shown_default="",
        ),
    )


@dataclass(frozen=True)
class EpChoice:
    """The MoE layers (indices) whose dispatch ``--ep`` writes, and whether it is measured
    (``why_derived`` empty) or derived (and why)."""

    moe_layers: list[int]
    why_derived: str
    #: how a measurement runs, for the file and the report
    group: str

    def apply(
        self, args: argparse.Namespace, model: Any, costs: ModelCosts, device: Any
    ) -> ModelCosts:
        """``costs`` with the MoE layers' dispatched bytes and the expert link."""
        import torch

        from pipetrain.planner.costs_file_moe import dispatched_bytes, with_dispatch

        link = args.ep_link_gbs
        how: dict[str, object] = {"link": "given" if link is not None else "none"}
        if self.why_derived:
            config = model.hf_config
            size = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
            tokens = args.microbatch_size * args.seq_len
            top_k, hidden = int(config.num_experts_per_tok), int(config.hidden_size)
            derived = dispatched_bytes(tokens, top_k, hidden, size, args.ep)
            per_layer = dict.fromkeys(self.moe_layers, derived)
            how.update(dispatched_bytes="derived", why_derived=self.why_derived)
            return with_dispatch(costs, per_layer, args.ep, link, how)
        from pipetrain.runtime.profile.profile_ep_measured import measure_expert_parallel

        build = functools.partial(expert_layers, args)
        measured = measure_expert_parallel(build, args.ep, device.type, repeats=args.repeats)
        if sorted(measured.dispatched_bytes) != self.moe_layers:  # another model than the profile's
            raise ValueError(
                f"--ep {args.ep}: the workers found MoE layers {sorted(measured.rows)}, the "
                f"profile {self.moe_layers}"
            )
        how.update(
            dispatched_bytes="measured",
            rows={str(i): n for i, n in sorted(measured.rows.items())},
            measured_on=self.group,
            link_points=measured.link_points,
        )
        if link is None:
            link = measured.link_gbs
            how["link"] = "measured"
        else:
            how["measured_link_gbs"] = measured.link_gbs
        return with_dispatch(costs, measured.dispatched_bytes, args.ep, link, how)


def ep_choice(args: argparse.Namespace, model: Any, device: Any) -> EpChoice | None:
    """``--ep``, ``--ep-measure`` and ``--ep-link-gbs`` checked for ``model`` on ``device``
    (``None``: no expert parallel asked for); ``ValueError`` for what cannot be done as asked."""
    from pipetrain.cli.profile_models import FolderModel

    mode = args.ep_measure
    if args.ep == 1:
        if args.ep_link_gbs is not None:
            raise ValueError("--ep-link-gbs prices expert parallel: give --ep E above 1 with it")
        if mode != "auto":
            raise ValueError(f"--ep-measure {mode} applies to expert parallel: give --ep E above 1")
        return None
    moe = model.moe_layers() if isinstance(model, FolderModel) else []
    if not moe:
        raise ValueError(
            f"--ep {args.ep}: {model.label} has no mixture-of-experts layers (no expert "
            "all-to-all to price); drop --ep, or give a mixture-of-experts --model-dir folder"
        )
    why = "--ep-measure derive" if mode == "derive" else _why_not_measured(args, model, device)
    if mode == "processes" and why:
        raise ValueError(f"--ep-measure processes: {why}; --ep-measure auto derives the bytes")
    cuda = device.type == "cuda"
    group = f"{'NCCL on GPUs' if cuda else 'gloo on CPU processes'}, one process per rank"
    return EpChoice(moe_layers=moe, why_derived=why, group=group)


def _why_not_measured(args: argparse.Namespace, model: Any, device: Any) -> str:
    """Why ``--ep`` cannot be measured here (empty: it can)."""
    import torch

    from pipetrain.hf.families import family_of

    family = family_of(model.hf_config)
    if family.expert_parallel is None:
        return f"expert parallel is not built for {family.model_type!r} models"
    experts = int(getattr(model.hf_config, family.num_experts))
    if experts % args.ep:
        return f"--ep {args.ep} does not divide the number of experts ({experts})"
    if device.type == "cuda":
        gpus = torch.cuda.device_count()
        return f"--ep {args.ep} needs {args.ep} GPUs, {gpus} visible" if args.ep > gpus else ""
    if args.ep_measure == "auto":
        return "on a CPU (--ep-measure processes to measure on gloo processes anyway)"
    return ""


def expert_layers(
    args: argparse.Namespace, mesh: Any, device: Any
) -> tuple[list[Any], tuple[Any, ...]]:
    """One worker's layers of the ``--model-dir`` folder (same weights as the profile's) on
    ``device``, their experts sharded over ``mesh`` (``("edp", "ep")``) as ``train --ep`` shards
    them, and a micro-batch at ``--seq-len`` as their first inputs: each rank its own, drawn
    from its ep rank as the seed (rank 0's is the profile's), as the replicas of a job see
    different batches and route them differently."""
    from pipetrain.app.launch import quiet_import_notices

    quiet_import_notices()  # before ``transformers`` is imported
    from pipetrain.cli.profile_models import FolderModel, sample_batch
    from pipetrain.runtime.parallel.expert_parallel import apply_expert_parallel

    model = FolderModel(args, args.seq_len)
    layers, _, batch, vocab, _ = model.at(args.seq_len)
    layers = [layer.to(device) for layer in layers]
    apply_expert_parallel(layers, mesh)
    seed = mesh.get_local_rank("ep")
    inputs, _ = sample_batch(args, batch, vocab, args.seq_len, device, seed=seed)
    return layers, inputs if isinstance(inputs, tuple) else (inputs,)


def ep_line(costs: ModelCosts) -> str | None:
    """The report's line: the degree, the MoE layers' largest dispatch, whether measured or
    derived, and the link and where it came from; ``None`` without expert parallel."""
    ep = costs.meta.get("ep")
    if not ep:
        return None
    moe = [x.dispatched_bytes for x in costs.layers if x.dispatched_bytes is not None]
    how = ep.get("dispatched_bytes", "derived")
    if how == "measured":
        how = f"measured on {ep['measured_on']}" if "measured_on" in ep else how
    elif "why_derived" in ep:
        how = f"derived: {ep['why_derived']}"
    link = " (no link: not priced)"
    if costs.ep_link_gbs:
        link = f" at {costs.ep_link_gbs:.3g} GB/s ({ep.get('link', 'given')})"
    return (
        f"expert parallel {ep['degree']}: {len(moe)} MoE layers dispatch up to "
        f"{max(moe, default=0.0) / 1e6:.3g} MB each per micro-batch ({how}){link}"
    )
