"""``pipetrain train``'s flags of the optimizer, the data, evaluation and metrics: the rows of its
flag table that ``train_command`` does not hold itself (that module stays readable).

Each flag is named as its ``TrainConfig`` field and takes that field's default; the learning-rate
flags default to None there and their help names both resolved defaults
(``app.lr_schedule.resolve_schedule``: a ``--model-dir`` fine-tune's and the built-in models').
"""

from __future__ import annotations

import argparse

from pipetrain.cli.flags import Option, one_of, positive_float, positive_int


def non_negative_int(text: str) -> int:
    """An integer >= 0 (warm-up steps)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (a final learning rate, weight decay)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def optimizer_options(choices: dict[str, tuple[str, ...]]) -> tuple[Option, ...]:
    """AdamW's rate, its schedule and weight decay, the router loss it minimises too, and how
    the experts of a mixture-of-experts model are spread (``--ep``)."""
    from pipetrain.app.lr_schedule import (
        FINE_TUNE_LR,
        FINE_TUNE_SCHEDULE,
        FINE_TUNE_WARMUP,
        SCRATCH_LR,
        SCRATCH_SCHEDULE,
    )

    return (
        Option(
            ("--lr",),
            type=positive_float,
            metavar="LR",
            help="AdamW's peak learning rate",
            shown_default=f"{FINE_TUNE_LR:g} with --model-dir, TRL's SFT default; else "
            f"{SCRATCH_LR:g}",
        ),
        Option(
            ("--lr-schedule",),
            metavar="{" + ",".join(choices["lr_schedule"]) + "}",
            choices=choices["lr_schedule"],
            help="how the rate decays after the warm-up, to --min-lr at the end of the run",
            shown_default=f"{FINE_TUNE_SCHEDULE} with --model-dir, else {SCRATCH_SCHEDULE}",
        ),
        Option(
            ("--warmup",),
            type=non_negative_int,
            metavar="STEPS",
            help="steps of linear warm-up from 0 to --lr",
            shown_default=f"{FINE_TUNE_WARMUP:.0%}% of --steps, at least 1, with --model-dir; "
            "else 0",
        ),
        Option(
            ("--min-lr",),
            type=non_negative_float,
            metavar="LR",
            help="the rate a cosine or linear schedule ends at",
            shown_default="0",
        ),
        Option(
            ("--weight-decay",),
            type=non_negative_float,
            metavar="WD",
            help="AdamW's decoupled weight decay, on parameters of 2 or more dimensions only "
            "(not norms, not biases)",
        ),
    )


def moe_options(choices: dict[str, tuple[str, ...]]) -> tuple[Option, ...]:
    """What a mixture-of-experts folder's layers add: router losses, the experts' kernel, the
    routing bias's update, expert parallel and the F&B pairs' overlap that hides its all-to-all."""
    return (
        one_of(
            "--router-aux-loss",
            choices["router_aux_loss"],
            "a mixture-of-experts --model-dir folder's router load-balancing loss: auto adds "
            "its config's router_aux_loss_coef × each MoE layer's balancing loss per "
            "micro-batch (Megatron-Core's and torchtitan's form) where that coefficient is not "
            "0; off trains without it",
        ),
        one_of(
            "--experts",
            choices["experts"],
            "a mixture-of-experts --model-dir folder's experts kernel: auto runs a grouped GEMM "
            "on CUDA bf16 with compute capability >= 9.0 and the loop over experts elsewhere; "
            "grouped and loop force one",
        ),
        Option(
            ("--expert-bias-rate",),
            type=non_negative_float,
            metavar="RATE",
            help="a --model-dir folder balanced without a loss (DeepSeek-V3): after each "
            "optimizer step every router's per-expert bias moves by RATE towards the experts "
            "that received fewer tokens than the mean, loads summed over micro-batches and "
            "data-parallel replicas (the DeepSeek-V3 report's bias update speed); 0 keeps the "
            "biases as loaded",
        ),
        Option(
            ("--ep",),
            type=positive_int,
            metavar="E",
            help="expert parallel for a mixture-of-experts --model-dir folder: each MoE layer's "
            "experts sharded over E of the --dp replicas (E divides --dp and the number of "
            "experts; tokens travel by all-to-all), with DDP or FSDP2 (--data-parallel); "
            "needs --tp 1",
        ),
        Option(
            ("--pair-overlap",),
            metavar="{" + ",".join(choices["pair_overlap"]) + "}",
            choices=choices["pair_overlap"],
            help="DualPipe's overlap in a schedule's F&B pairs (dualpipe, dualpipev): one "
            "micro-batch's forward runs on a second thread (and CUDA stream) while another's "
            "backward runs, so one's expert all-to-all hides under the other's compute; off "
            "runs each pair's parts one after the other (same numbers either way)",
            shown_default="auto: on with --ep > 1, else off",
        ),
    )


def data_options(choices: dict[str, tuple[str, ...]]) -> tuple[Option, ...]:
    """What the run trains on, and how documents become rows."""
    return (
        Option(
            ("--data", "--text"),
            metavar="FILE",
            help="the text to train on (default: the generated corpus)",
        ),
        one_of(
            "--text-unit",
            choices["text_unit"],
            "what one document of a text file is: a line, or a paragraph (blank-line separated)",
        ),
        one_of(
            "--packing",
            choices["packing"],
            "rows: documents packed end to end (attention kept within each), or one document a "
            "row, padded",
        ),
        one_of(
            "--long-documents",
            choices["long_documents"],
            "a document longer than --seq-len: split into rows, or refused naming it",
        ),
        Option(
            ("--data-cache",),
            metavar="DIR",
            help="where tokenized data is kept between runs (default: none kept)",
        ),
        one_of(
            "--microbatch-balance",
            choices["microbatch_balance"],
            "how rows are dealt to micro-batches: balanced by real tokens, or in order",
        ),
        Option(
            ("--global-batch-tokens",),
            type=positive_int,
            metavar="N",
            help="a step is N real tokens over every replica, not a fixed count of "
            "micro-batches: each step runs as many micro-batches as its documents fill, "
            "rounded to the nearest count the schedule runs, the rest carried to the next "
            "step (with --packing documents; instead of -m)",
            shown_default="off: -m micro-batches a step",
        ),
        Option(
            ("--costs",),
            metavar="FILE",
            help="balance micro-batches by the per-token and per-token² costs that `pipetrain "
            "profile --seq-lens` fitted into this costs file",
            shown_default="a transformer's FLOPs at the model's width",
        ),
        Option(
            ("--prefetch-batches",),
            type=non_negative_int,
            metavar="N",
            help="steps' batches built ahead on a background thread while the pipeline runs, "
            "as DataLoader's prefetch_factor; 0 builds each in the loop, between steps",
        ),
    )


def eval_options() -> tuple[Option, ...]:
    """The held-out loss and the metrics the run writes."""
    return (
        Option(
            ("--eval-data",),
            metavar="FILE",
            help="held-out text: its loss (the token mean over the whole file) is computed "
            "forward only and printed, and recorded in --metrics",
        ),
        Option(
            ("--eval-every",),
            type=positive_int,
            metavar="N",
            help="evaluate every N steps, and after the last",
            shown_default="every --checkpoint-every steps if given, and after the last step",
        ),
        Option(
            ("--metrics",),
            metavar="FILE",
            help="write one JSON line per step (loss, lr, grad_norm, tokens, padding_tokens, "
            "tok_per_s, data_ms, mfu, eval_loss, aux_loss/NAME of a router's loss, microbatches under "
            "--global-batch-tokens), and at the end FILE's loss and lr drawn as SVG beside it; "
            "--resume keeps the lines up to its step",
        ),
        Option(
            ("--tensorboard",),
            metavar="DIR",
            help="write the same scalars as TensorBoard events under DIR (needs pip install "
            "'pipetrain[data]')",
        ),
    )


def guard_options(choices: dict[str, tuple[str, ...]]) -> tuple[Option, ...]:
    """How the run behaves at a non-finite step, and its kernels' determinism."""
    return (
        Option(
            ("--max-skipped",),
            type=positive_int,
            metavar="K",
            help="with --on-nonfinite skip: stop after K consecutive skipped steps",
        ),
        one_of(
            "--attention",
            choices["attention"],
            "attention kernel: flex attention, SDPA, or auto (flex on CUDA, SDPA elsewhere)",
        ),
        Option(
            ("--deterministic",),
            switch=True,
            help="deterministic kernels only (torch.use_deterministic_algorithms): repeatable "
            "runs, at some speed",
        ),
        Option(
            ("--gc-every",),
            type=non_negative_int,
            metavar="N",
            help="collect Python's garbage every N steps on every rank and never in between, "
            "so collections do not stall steps at random (0: Python's automatic collection)",
        ),
    )


def checkpoint_options() -> tuple[Option, ...]:
    """How checkpoints are written: in the background, and how many are kept."""
    return (
        Option(
            ("--async-checkpoint",),
            switch=True,
            help="write checkpoints in the background (DCP's async_save): a save costs the step "
            "the copy of the state to CPU memory (pinned, on a side stream, on GPUs), not the "
            "write; a checkpoint counts (latest, --resume) only once complete, and the next "
            "save and the end of the run wait for it",
        ),
        Option(
            ("--keep-checkpoints",),
            type=positive_int,
            metavar="K",
            help="once a checkpoint is complete, remove the oldest complete ones beyond K",
            shown_default="keep all",
        ),
    )


def resilience_options() -> tuple[Option, ...]:
    """What the run does when a worker dies or the job is told to stop (docs/resilience.md)."""
    from pipetrain.app.termination import TERMINATED

    return (
        Option(
            ("--max-restarts",),
            type=non_negative_int,
            metavar="N",
            help="restart every worker up to N times after one dies or fails (torchrun's elastic "
            "agent, on this machine); a restart resumes from the latest complete checkpoint in "
            "--checkpoint-dir",
        ),
        Option(
            ("--checkpoint-on-term",),
            switch=True,
            help="on SIGTERM (Slurm, Kubernetes), every rank finishes its step, a checkpoint is "
            f"written and the run exits {TERMINATED}; without it SIGTERM stops the run at once",
        ),
        Option(
            ("--term-grace",),
            type=positive_float,
            metavar="SECONDS",
            help="after SIGTERM, how long the workers may take to stop before they are killed "
            "(keep it under the scheduler's own, e.g. Slurm's KillWait)",
        ),
    )


__all__ = [
    "checkpoint_options",
    "data_options",
    "eval_options",
    "guard_options",
    "moe_options",
    "non_negative_float",
    "non_negative_int",
    "optimizer_options",
    "resilience_options",
]
