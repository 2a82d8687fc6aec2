"""What one ``pipetrain train`` run is asked to do: ``TrainConfig``.

``TrainConfig`` is the typed form of the ``train`` flags: the command line builds one from what it
parsed (``cli.train_command``), and the launcher, the training loop and the report read it. A
field is named as its flag (``--clip-grad-norm`` is ``clip_grad_norm``), so ``argv`` writes the
command line that every worker parses back into the same config. Its defaults are the flags'
defaults. Constructing one checks each field on its own (a value the flag would refuse raises
``ValueError`` naming the flag and the legal values), so a config built in code is held to what
the command line accepts.

The checks that read files or span fields, and the layout a config runs, are
``app.train_checks``'s: this module is the format every other part of the application reads, so
it imports none of them.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, get_args

from pipetrain.app.catalog import MODELS, ModelShape

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
RouterAuxLoss = Literal["auto", "off"]
Experts = Literal["auto", "grouped", "loop"]
PairOverlap = Literal["auto", "on", "off"]
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
    "router_aux_loss": get_args(RouterAuxLoss),
    "experts": get_args(Experts),
    "pair_overlap": get_args(PairOverlap),
}
#: numeric fields where 0 is legal (the others but the seed must be > 0)
NON_NEGATIVE = (
    "warmup",
    "min_lr",
    "weight_decay",
    "gc_every",
    "max_restarts",
    "expert_bias_rate",
    "prefetch_batches",
)
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
    #: (``planner.recompute_modes.StageRecompute``'s written form); None: none, or the plan's
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
    #: expert parallel: each MoE layer's experts sharded over ``ep`` of the ``dp`` replicas
    ep: int = 1
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
    #: a mixture-of-experts folder's router load-balancing loss: ``auto`` trains with its
    #: config's ``router_aux_loss_coef`` where that is not 0 (``app.model_folder``)
    router_aux_loss: RouterAuxLoss = "auto"
    #: a mixture-of-experts folder's experts kernel: ``auto`` a grouped GEMM on CUDA bf16 with
    #: compute capability >= 9.0, the loop over experts elsewhere (``hf.experts_kernel``)
    experts: Experts = "auto"
    #: the per-expert routing bias's update speed after each optimizer step, for families
    #: balanced without a loss (DeepSeek-V3: ``pipetrain.hf.expert_bias``); 0 keeps the biases
    expert_bias_rate: float = 0.001
    #: an F&B pair's forward on a lane of its own while its backward runs (``Pipeline``'s
    #: ``overlap_pairs``; ``runtime.pair_lanes``): ``auto`` on with expert parallel
    pair_overlap: PairOverlap = "auto"
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
    #: write checkpoints in the background (app.checkpoints, runtime.checkpoint_async)
    async_checkpoint: bool = False
    #: keep the newest K complete checkpoints (None: all)
    keep_checkpoints: int | None = None
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
    #: a step's real tokens over every replica (None: ``microbatches`` micro-batches a step);
    #: each step runs as many micro-batches as its documents fill (``app.data.token_budget``)
    global_batch_tokens: int | None = None
    #: a costs file whose length coefficients balance micro-batches (``profile --seq-lens``)
    costs: str | None = None
    #: batches built ahead of the loop on a background thread (``app.data.prefetch``); 0: each
    #: built in the loop, between steps
    prefetch_batches: int = 1
    deterministic: bool = False
    #: collect Python's garbage every this many steps, never in between (0: Python's own)
    gc_every: int = 50
    timeout: float = 300.0
    #: restarts of every worker after one fails (``app.restart``); 0: the run stops instead
    max_restarts: int = 0
    #: on SIGTERM, every rank finishes its step and a checkpoint is written (``app.termination``)
    checkpoint_on_term: bool = False
    #: how long the workers may take to stop after SIGTERM before they are killed (s)
    term_grace: float = 30.0
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


__all__ = [
    "CHOICES",
    "DEFAULT_MICROBATCHES",
    "DEFAULT_RANKS",
    "DEFAULT_SCHEDULE",
    "TrainConfig",
    "flags_given",
]
