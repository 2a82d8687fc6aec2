"""The run's pipeline layout, and every check of ``pipetrain train``'s arguments that needs no
process.

``check_arguments`` validates the flags (a bad value is named with the legal ones) and turns them
into a ``Layout``: the plan in ``--plan FILE`` (``pipetrain plan --json``, read as
``Layout.from_json`` reads it, as ``Pipeline.from_plan`` does), or the shape flags with the default cut (blocks spread evenly,
embedding and head on the end stages). The launcher calls it before any process starts, so bad
input exits 2 at once rather than in every worker; each worker calls it again for its layout.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
from pathlib import Path

from pipetrain.app.catalog import BYTE_VOCAB, ModelShape, default_stage_layers
from pipetrain.app.options import (
    DEFAULT_MICROBATCHES,
    DEFAULT_RANKS,
    DEFAULT_SCHEDULE,
    OPTIONS,
    model_shape,
)
from pipetrain.flags import shape_flags_given
from pipetrain.planner.layout import Layout
from pipetrain.schedule.registry import FAMILIES, build_schedule, family


def check_arguments(args: argparse.Namespace) -> Layout:
    """Validate everything that needs no process; return the pipeline layout.

    Raises ``ValueError`` naming the bad value and the legal ones.
    """
    for opt in OPTIONS:
        value = getattr(args, opt.dest)
        if opt.choices and value not in opt.choices:
            raise ValueError(f"{opt.flags[0]} must be one of {', '.join(opt.choices)}")
        if opt.dest == "receive_lead":
            if value is not None and (type(value) is not int or value < 0):
                raise ValueError(f"{opt.flags[0]} must be none or an integer >= 0, got {value}")
        elif type(value) in (int, float) and opt.dest != "seed" and value <= 0:
            raise ValueError(f"{opt.flags[0]} must be > 0, got {value}")
    shape = model_shape(args)
    shape.check()
    if args.model != "gpt" and importlib.util.find_spec("transformers") is None:
        raise ValueError(
            f"--model {args.model} needs transformers: pip install 'pipetrain[hf]' (or train "
            "the built-in model: --model gpt)"
        )
    if args.vocab < BYTE_VOCAB:
        raise ValueError(f"--vocab {args.vocab}: the tokens are bytes, so it must be >= 256")
    if args.text is not None and not Path(args.text).is_file():
        raise ValueError(f"--text {args.text}: no such file")
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if args.checkpoint_every is not None and args.checkpoint_dir is None:
        raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
    if args.resume:  # the checkpoint is there and of this model (a file read, no process)
        from pipetrain.app.checkpoints import Checkpoints

        Checkpoints(args.checkpoint_dir, shape).latest()
    layout = _layout(args, shape)
    if shape.num_layers < len(layout.stage_layers):
        raise ValueError(
            f"--layers {args.layers} gives {shape.num_layers} layers (with the embedding and "
            f"head) for {len(layout.stage_layers)} stages; every stage needs a layer: use "
            f"--layers >= {args.layers + len(layout.stage_layers) - shape.num_layers}"
        )
    if sum(layout.stage_layers) != shape.num_layers:
        raise ValueError(
            f"the plan in {args.plan} cuts {sum(layout.stage_layers)} layers "
            f"{list(layout.stage_layers)}, but --model {args.model} --layers {args.layers} has "
            f"{shape.num_layers}; plan from a profile of the same model (`pipetrain profile "
            f"--model {args.model} --layers {args.layers}`)"
        )
    return layout


def _layout(args: argparse.Namespace, shape: ModelShape) -> Layout:
    if not family(args.schedule or DEFAULT_SCHEDULE).runnable:  # family() names unknown ones
        runnable = ", ".join(f.name for f in FAMILIES.values() if f.runnable)
        raise ValueError(
            f"{args.schedule} is for planning only (two copies of the model); train with one of "
            f"{runnable}"
        )
    if args.plan is not None:
        given = shape_flags_given(args)
        if given:
            raise ValueError(
                f"--plan {args.plan} gives the schedule and its shape; drop {', '.join(given)}"
            )
        return _read_plan(args.plan)
    program = build_schedule(
        args.schedule or DEFAULT_SCHEDULE,
        args.ranks or DEFAULT_RANKS,
        args.microbatches or DEFAULT_MICROBATCHES,
        args.stages_per_rank,
    )
    if program.num_stages > shape.num_layers:
        counts: tuple[int, ...] = (
            1,
        ) * program.num_stages  # refused by the caller with the layer count
    else:
        counts = default_stage_layers(shape.model, shape.blocks, program.num_stages)
    return Layout(
        schedule=program.name,
        ranks=program.num_ranks,
        stages_per_rank=program.num_stages // program.num_ranks,
        microbatches=program.num_microbatches,
        stage_layers=tuple(counts),
    )


def _read_plan(path: str) -> Layout:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--plan {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--plan {path} is not JSON ({e}); write it with `pipetrain plan --json`"
        ) from None
    try:
        layout = Layout.from_json(raw)
    except ValueError as e:
        raise ValueError(f"--plan {path}: {e}") from None
    program = build_schedule(
        layout.schedule, layout.ranks, layout.microbatches, layout.stages_per_rank
    )
    if not family(program.name).runnable or program.placement.num_chains > 1:
        raise ValueError(f"--plan {path}: {program.name} holds two copies of the model")
    return dataclasses.replace(layout, schedule=program.name)


__all__ = ["check_arguments"]
