"""What one ``pipetrain train`` run is asked to do: ``TrainConfig``, its checks, and the pipeline
layout it runs.

``TrainConfig`` is the typed form of the ``train`` flags: the command line builds one from what it
parsed (``cli.train_command``), and the launcher, the training loop and the report read it. A
field is named as its flag (``--clip-grad-norm`` is ``clip_grad_norm``), so ``argv`` writes the
command line that every worker parses back into the same config. Its defaults are the flags'
defaults. Constructing one checks each field on its own (a value the flag would refuse raises
``ValueError`` naming the flag and the legal values), so a config built in code is held to what
the command line accepts.

``check_arguments`` does the checks that read files or span fields (the model's shape, or the
``--model-dir`` folder's with its tokenizer and the ``--export`` folder: ``app.model_folder``;
the plan file, the checkpoint to resume) and turns the config into a ``Layout``: the plan in ``--plan FILE``
(``pipetrain plan --json``, read as ``Layout.from_json`` reads it, as ``Pipeline.from_plan``
does), or the shape flags with the default cut (blocks spread evenly, embedding and head on the
end stages). The launcher calls it before any process starts, so bad input exits 2 at once rather
than in every worker; each worker calls it again for its layout.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from pipetrain.app.catalog import BYTE_VOCAB, MODELS, ModelShape, default_stage_layers
from pipetrain.planner.layout import Layout
from pipetrain.schedule.registry import FAMILIES, build_schedule, family

#: the shape ``pipetrain train`` runs without flags or a plan
DEFAULT_SCHEDULE, DEFAULT_RANKS, DEFAULT_MICROBATCHES = "1f1b", 2, 4

Dtype = Literal["float32", "bfloat16", "float64"]
DataParallel = Literal["ddp", "fsdp"]
Device = Literal["auto", "cpu", "cuda"]
WeightGrads = Literal["auto", "deferred", "replay"]
OnNonfinite = Literal["stop", "skip"]
LrScheduleKind = Literal["constant", "cosine", "linear"]
TextUnit = Literal["line", "paragraph"]
Packing = Literal["documents", "none"]
LongDocuments = Literal["split", "refuse"]
Attention = Literal["auto", "flex", "sdpa"]
MicrobatchBalance = Literal["length", "fixed"]
#: field → its legal values
CHOICES: dict[str, tuple[str, ...]] = {
    "model": MODELS,
    "dtype": get_args(Dtype),
    "data_parallel": get_args(DataParallel),
    "device": get_args(Device),
    "weight_grads": get_args(WeightGrads),
    "on_nonfinite": get_args(OnNonfinite),
    "lr_schedule": get_args(LrScheduleKind),
    "text_unit": get_args(TextUnit),
    "packing": get_args(Packing),
    "long_documents": get_args(LongDocuments),
    "attention": get_args(Attention),
    "microbatch_balance": get_args(MicrobatchBalance),
}
#: numeric fields where 0 is legal (the others but the seed must be > 0)
NON_NEGATIVE = ("warmup", "min_lr", "weight_decay")
#: the fields that give the pipeline's shape (a plan gives them instead)
SHAPE_FIELDS = ("schedule", "ranks", "microbatches", "stages_per_rank", "recompute")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run, as its flags describe it (each field is the flag of its name)."""

    # the pipeline's shape: None takes the plan's (``plan``), else the DEFAULT_* above
    schedule: str | None = None
    ranks: int | None = None
    microbatches: int | None = None
    stages_per_rank: int | None = None
    #: activation checkpointing: one mode for every stage or one per stage, comma-separated
    #: (``planner.recompute.StageRecompute``'s written form); None: none, or the plan's
    recompute: str | None = None
    # a Hugging Face model folder to fine-tune (its config.json gives the model)
    model_dir: str | None = None
    # the model (``pipetrain profile`` takes these too)
    model: str = "llama"
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    vocab: int = 256
    seq_len: int = 64
    tie_embeddings: bool = False
    dtype: Dtype = "float32"
    seed: int = 0
    microbatch_size: int = 4
    # the run
    dp: int = 1
    data_parallel: DataParallel = "fsdp"
    tp: int = 1
    sequence_parallel: bool = False
    steps: int = 60
    #: the optimizer; None: resolved by ``app.lr_schedule.resolve_schedule`` (a fine-tune's
    #: defaults with ``model_dir``, the from-scratch demo's without)
    lr: float | None = None
    lr_schedule: LrScheduleKind | None = None
    warmup: int | None = None
    min_lr: float | None = None
    weight_decay: float = 0.0
    clip_grad_norm: float | None = None
    #: the training text (``--data``, alias ``--text``)
    data: str | None = None
    text_unit: TextUnit = "line"
    packing: Packing = "documents"
    long_documents: LongDocuments = "split"
    data_cache: str | None = None
    eval_data: str | None = None
    #: None: after the last step, and every ``checkpoint_every`` steps if given
    eval_every: int | None = None
    metrics: str | None = None
    tensorboard: str | None = None
    corpus_out: str = "out/corpus.txt"
    plan: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False
    overwrite_checkpoints: bool = False
    #: check every file of the checkpoint resumed against its SHA256SUMS first
    verify_checkpoint: bool = False
    on_nonfinite: OnNonfinite = "stop"
    max_skipped: int = 3
    export: str | None = None
    overwrite_export: bool = False
    svg: str = "out/train_step.svg"
    #: where to write the measured step as a Chrome/Perfetto trace (None: not written)
    trace: str | None = None
    device: Device = "auto"
    weight_grads: WeightGrads = "auto"
    receive_lead: int | None = 1
    cuda_graph: bool = False
    compile: bool = False
    float8: bool = False
    attention: Attention = "auto"
    microbatch_balance: MicrobatchBalance = "length"
    deterministic: bool = False
    timeout: float = 300.0
    #: set by the launcher on the processes it starts
    worker: bool = False

    def __post_init__(self) -> None:
        for name in _field_names():
            value, flag = getattr(self, name), _flag(name)
            if name in CHOICES and value is not None and value not in CHOICES[name]:
                raise ValueError(f"{flag} must be one of {', '.join(CHOICES[name])}")
            if name == "receive_lead":
                if value is not None and (type(value) is not int or value < 0):
                    raise ValueError(f"{flag} must be none or an integer >= 0, got {value}")
            elif type(value) not in (int, float) or name == "seed":
                continue
            elif name in NON_NEGATIVE and not 0 <= value < float("inf"):
                raise ValueError(f"{flag} must be >= 0, got {value}")
            elif name not in NON_NEGATIVE and not 0 < value < float("inf"):
                raise ValueError(f"{flag} must be > 0, got {value}")

    @property
    def text(self) -> str | None:
        """``--data`` by its older name (``--text``, still accepted on the command line)."""
        return self.data

    @property
    def shape(self) -> ModelShape:
        """The model these fields describe (a checkpoint is resumed only by the same shape)."""
        return ModelShape(
            model=self.model,
            blocks=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            kv_heads=self.kv_heads,
            vocab=self.vocab,
            seq_len=self.seq_len,
            dtype=self.dtype,
            seed=self.seed,
            tie_embeddings=self.tie_embeddings,
        )

    def argv(self) -> list[str]:
        """The flags that reproduce this config (what the launcher passes to every worker)."""
        out: list[str] = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if type(value) is bool:
                out += [_flag(field.name)] if value else []
            elif value is not None:
                out += [_flag(field.name), str(value)]
            elif field.default is not None:  # a flag that takes "none" (``--receive-lead``)
                out += [_flag(field.name), "none"]
        return out

    def shape_flags_given(self) -> list[str]:
        """The shape flags set (to name them when a plan gives the shape)."""
        return [_flag(name) for name in SHAPE_FIELDS if getattr(self, name) is not None]


def flags_given(config: TrainConfig, names: tuple[str, ...]) -> list[str]:
    """The flags among the fields ``names`` that ``config`` sets to other than their defaults
    (to name them where they do not apply)."""
    defaults = TrainConfig()
    return [_flag(n) for n in names if getattr(config, n) != getattr(defaults, n)]


def _field_names() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(TrainConfig))


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_arguments(config: TrainConfig) -> Layout:
    """Check everything that needs no process; return the pipeline layout.

    Raises ``ValueError`` naming the bad value and the legal ones.
    """
    shape = run_shape(config)
    _check_data_flags(config)
    if config.resume and config.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if config.checkpoint_every is not None and config.checkpoint_dir is None:
        raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
    _check_tensor_parallel(config, shape)
    from pipetrain.app.lr_schedule import resolve_schedule
    from pipetrain.app.metrics import check_metrics

    resolve_schedule(config)
    check_metrics(config)
    from pipetrain.app.checkpoints import Checkpoints, check_directory
    from pipetrain.app.model_folder import check_data, check_export

    if not config.worker:  # the launcher's: workers may find this run's first files
        check_directory(config)
        check_export(config)
    if config.resume and config.checkpoint_dir is not None:  # complete and of this model
        Checkpoints(config.checkpoint_dir, shape).latest()
    layout = _layout(config, shape)
    _check_cuda_graph(config)
    from pipetrain.app import kernels

    kernels.check(config)
    if config.model_dir is None:
        _check_text(config, layout)
    elif not config.worker:  # tokenized once, by the launcher
        check_data(config, shape.vocab)
    if not config.worker:
        from pipetrain.app.evaluation import check_eval

        check_eval(config, config.microbatch_size * layout.microbatches * config.dp)
    if shape.num_layers < len(layout.stage_layers):
        more = shape.num_layers - len(layout.stage_layers)
        raise ValueError(
            f"{_blocks(config, shape)} gives {shape.num_layers} layers (with the embedding and "
            f"head) for {len(layout.stage_layers)} stages; every stage needs a layer: "
            + (
                f"use --layers >= {config.layers - more}"
                if config.model_dir is None
                else "use fewer stages"
            )
        )
    if sum(layout.stage_layers) != shape.num_layers:
        raise ValueError(
            f"the plan in {config.plan} cuts {sum(layout.stage_layers)} layers "
            f"{list(layout.stage_layers)}, but {_blocks(config, shape)} has {shape.num_layers}; "
            "plan from a profile of the same model"
            + (
                f" (`pipetrain profile --model {config.model} --layers {config.layers}`)"
                if config.model_dir is None
                else ""
            )
        )
    return layout


#: the flags that say how a ``--model-dir`` folder's tokenizer reads the data (the built-in
#: models read a text file's bytes as they are)
FOLDER_DATA_FIELDS = ("text_unit", "packing", "long_documents", "data_cache", "microbatch_balance")


def _check_data_flags(config: TrainConfig) -> None:
    """``--data`` and ``--eval-data`` exist (a file, or a ``datasets`` folder with
    ``--model-dir``); the flags for tokenized data need ``--model-dir``."""
    folder = config.model_dir is not None
    for flag, path in (("--data", config.data), ("--eval-data", config.eval_data)):
        if path is None:
            continue
        if not Path(path).exists() or (Path(path).is_dir() and not folder):
            raise ValueError(f"{flag} {path}: no such file")
        if not folder and Path(path).suffix not in ("", ".txt"):
            raise ValueError(
                f"{flag} {path}: the built-in models read a text file's bytes; JSONL, chat, "
                "parquet and datasets folders need a tokenizer: give --model-dir DIR"
            )
    if not folder:
        given = flags_given(config, FOLDER_DATA_FIELDS)
        if given:
            raise ValueError(
                f"{', '.join(given)}: for a --model-dir folder's tokenized data (the built-in "
                "models read the text's bytes); drop it or give --model-dir DIR"
            )


def _check_cuda_graph(config: TrainConfig) -> None:
    """``--cuda-graph`` where the runtime captures a step (docs/runtime.md, "Whole-step CUDA
    graphs"): on GPUs, no data or tensor parallel."""
    if not config.cuda_graph:
        return
    if config.device == "cpu":
        raise ValueError("--cuda-graph captures each step on a GPU; drop it or --device cpu")
    if config.dp > 1 or config.tp > 1:
        raise ValueError(
            "--cuda-graph with --dp or --tp is not supported yet (their gradient syncs keep "
            "host-side state per step); drop --cuda-graph or run --dp 1 --tp 1"
        )


def run_shape(config: TrainConfig) -> ModelShape:
    """The model the run trains: the folder's (``--model-dir``) or the built-in model flags',
    checked."""
    if config.model_dir is not None:
        from pipetrain.app.model_folder import folder_config, folder_shape

        return folder_shape(config, folder_config(config))
    shape = config.shape
    shape.check()
    if config.model != "gpt":
        from pipetrain.hf.causal_lm import transformers_problem

        problem = transformers_problem()
        if problem is not None:
            raise ValueError(
                f"--model {config.model}: {problem} (or train the built-in model: --model gpt)"
            )
    if config.vocab < BYTE_VOCAB:
        raise ValueError(f"--vocab {config.vocab}: the tokens are bytes, so it must be >= 256")
    return shape


def _blocks(config: TrainConfig, shape: ModelShape) -> str:
    """The flags that gave the model's layers, to name them."""
    if config.model_dir is not None:
        return f"--model-dir {config.model_dir} ({shape.blocks} decoder layers)"
    return f"--model {config.model} --layers {config.layers}"


def _check_tensor_parallel(config: TrainConfig, shape: ModelShape) -> None:
    """``--tp``: the Llama family's plan (``pipetrain.hf.parallelize_causal_lm``) splits heads,
    key/value heads and the MLP's intermediate features (4 × hidden) over the tp ranks, and with
    ``--sequence-parallel`` the tokens."""
    if config.sequence_parallel and config.tp == 1:
        raise ValueError("--sequence-parallel needs --tp N with N > 1")
    if config.tp == 1:
        return
    if shape.model in ("gpt", "gpt2"):
        raise ValueError(
            "--tp needs a Hugging Face Llama-family model (--model llama, qwen3 or mistral, or a "
            f"--model-dir of one); {shape.model} has no tensor-parallel plan"
        )
    if config.data_parallel == "ddp" and config.dp > 1:
        raise ValueError("--tp with --dp needs --data-parallel fsdp (DDP replicates plain tensors)")
    for flag, value in (
        ("--heads", shape.heads),
        ("--kv-heads", shape.kv_heads),
        ("--hidden", shape.hidden),
    ):
        if value % config.tp:
            raise ValueError(f"--tp {config.tp} must divide {flag} {value}")
    if config.sequence_parallel and config.seq_len % config.tp:
        raise ValueError(
            f"--sequence-parallel shards the tokens: --tp {config.tp} must divide --seq-len "
            f"{config.seq_len}"
        )


def _check_text(config: TrainConfig, layout: Layout) -> None:
    """``--data`` holds one batch of the asked shape: every row a window of ``--seq-len`` bytes
    and the byte after it (its target)."""
    if config.data is None:
        return
    rows = config.microbatch_size * layout.microbatches * config.dp
    need = rows * (config.seq_len + 1)
    size = Path(config.data).stat().st_size
    if size < need:
        raise ValueError(
            f"--data {config.data} has {size} bytes; one batch of {rows} rows (--microbatch-size "
            f"{config.microbatch_size} × --microbatches {layout.microbatches} × --dp {config.dp}) "
            f"of --seq-len {config.seq_len} bytes and a target byte each needs at least {need}: "
            "give a longer text, or smaller flags"
        )


def _layout(config: TrainConfig, shape: ModelShape) -> Layout:
    if not family(config.schedule or DEFAULT_SCHEDULE).runnable:  # family() names unknown ones
        runnable = ", ".join(f.name for f in FAMILIES.values() if f.runnable)
        raise ValueError(
            f"{config.schedule} is for planning only (two copies of the model); train with one "
            f"of {runnable}"
        )
    if config.plan is not None:
        given = config.shape_flags_given()
        if given:
            raise ValueError(
                f"--plan {config.plan} gives the schedule and its shape; drop {', '.join(given)}"
            )
        return _read_plan(config.plan)
    program = build_schedule(
        config.schedule or DEFAULT_SCHEDULE,
        config.ranks or DEFAULT_RANKS,
        config.microbatches or DEFAULT_MICROBATCHES,
        config.stages_per_rank,
    )
    if program.num_stages > shape.num_layers:
        # one layer a stage: refused by the caller, which names the layer count
        counts: tuple[int, ...] = (1,) * program.num_stages
    else:
        counts = default_stage_layers(shape.model, shape.blocks, program.num_stages)
    modes = _recompute_modes(config.recompute, program.num_stages)
    try:
        return Layout(
            schedule=program.name,
            ranks=program.num_ranks,
            stages_per_rank=program.num_stages // program.num_ranks,
            microbatches=program.num_microbatches,
            stage_layers=tuple(counts),
            recompute=modes,
        )
    except ValueError as e:
        raise ValueError(f"--recompute {config.recompute}: {e}") from None


def _recompute_modes(flag: str | None, num_stages: int) -> tuple[str, ...]:
    """``--recompute`` per stage: one mode for all, or one per stage (checked by ``Layout``
    against each stage's layers)."""
    if flag is None:
        return ()
    modes = tuple(m.strip() for m in flag.split(","))
    if len(modes) == 1:
        return modes * num_stages
    if len(modes) != num_stages:
        raise ValueError(
            f"--recompute {flag} gives {len(modes)} modes for {num_stages} stages; give one mode "
            "for every stage or one per stage"
        )
    return modes


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


__all__ = [
    "CHOICES",
    "DEFAULT_MICROBATCHES",
    "DEFAULT_RANKS",
    "DEFAULT_SCHEDULE",
    "TrainConfig",
    "check_arguments",
    "run_shape",
]
