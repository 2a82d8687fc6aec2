"""Where ``pipetrain train`` gets its batches: one record per step for training, a fixed list of
records for evaluation, each carrying its own token counts.

A ``StepBatch`` is what the loop needs of a step's data: the inputs for stage 0, the targets for
the loss, side inputs by name (position ids of packed documents, or an attention mask), and how
many of its tokens are real and how many padding (the metrics count them from the record, not
from a mask). ``train_batches`` gives windows of a text file's bytes for the built-in models; for
``--model-dir`` it gives the folder tokenizer's documents from ``app.data``: read from ``--data``
(text, JSONL text or chat, a ``datasets`` folder), tokenized once into the data cache, and packed
into rows with their boundaries kept (``--packing documents``, micro-batches balanced by cost) or
one per right-padded row (``--packing none``). Step ``s``'s batch is a function of the seed and
``s``, so a resumed run starts at its step without replaying the data. ``eval_batches`` reads
``--eval-data`` in order, every document (or byte) once: byte windows of ``--seq-len`` that
overlap by one byte, so each byte after the first is predicted exactly once, or the folder's
rows packed as training packs them. Evaluation targets are aligned with the logits (position t
predicts target t; -100 where nothing is predicted); the last batch of byte windows is filled
up to the pipeline's batch size with copies of a row whose targets are all -100, so it counts
nothing.

These two functions are the only place the loop reads data, so another source (packed
documents, JSONL, chat) replaces them without touching the loop.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pipetrain.app.model_folder import run_shape

if TYPE_CHECKING:
    import torch

    from pipetrain.app.catalog import LayerModel
    from pipetrain.app.config import TrainConfig
    from pipetrain.app.data import DataOptions, TokenBudget, TokenCorpus
    from pipetrain.planner.varlen import LengthCost

#: a target that predicts nothing (``transformers``' and ``F.cross_entropy``'s ignore index)
IGNORE_INDEX = -100


@dataclass
class StepBatch:
    """One step's batch, every data-parallel replica's rows (see the module docstring)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    side: dict[str, torch.Tensor] = field(default_factory=dict)
    #: tokens predicted (training: the real tokens; evaluation: targets that are not -100)
    real_tokens: int = 0
    padding_tokens: int = 0
    #: micro-batches per replica, where the step has its own count (``--global-batch-tokens``)
    microbatches: int | None = None

    def share(self, replica: int, dp: int) -> slice:
        """Replica ``replica``'s rows of the step's ``dp`` equal shares."""
        per = len(self.inputs) // dp
        return slice(replica * per, (replica + 1) * per)

    def rows(self, mine: slice, device: torch.device) -> StepBatch:
        """The rows ``mine`` (one replica's share) on ``device``; counts are the whole batch's."""
        return dataclasses.replace(
            self,
            inputs=self.inputs[mine].to(device),
            targets=self.targets[mine].to(device),
            side={k: v[mine].to(device) for k, v in self.side.items()},
        )


def text_path(config: TrainConfig) -> Path:
    """The text to train on: ``--text``, else the generated corpus (written first if missing)."""
    path = Path(config.text) if config.text is not None else Path(config.corpus_out)
    if config.text is None and not path.is_file():
        from pipetrain.app.models.data import make_corpus

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several ranks may write at once
        tmp.write_bytes(make_corpus())
        tmp.replace(path)
    return path


def read_tokens(config: TrainConfig) -> torch.Tensor:
    """The text file's bytes as token ids (the generated corpus, written first, by default)."""
    import torch

    path = text_path(config)
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def train_batches(
    config: TrainConfig, model: LayerModel | None, microbatches: int, start: int = 0
) -> Iterator[StepBatch]:
    """Endless training batches from step ``start`` on (every replica's rows; ``microbatches``
    per replica), each drawn from the seed and its step, so a resumed run sees the batches the
    uninterrupted one did: windows of the text's bytes for the built-in ``model``; for
    ``--model-dir`` (``model`` None), the folder tokenizer's documents packed or padded into rows
    (``folder_batches``)."""
    if model is None:
        yield from folder_batches(config, microbatches, start)
        return
    from pipetrain.app.models.data import batches

    rows = config.microbatch_size * microbatches * config.dp
    drawn = batches(read_tokens(config), rows, config.seq_len, config.seed)
    for step, (window, shifted) in enumerate(drawn):
        if step >= start:  # the earlier steps' draws, made and dropped: the same stream
            inputs, targets = model.batch(window, shifted)
            yield StepBatch(inputs, targets, {}, window.numel(), 0)


def folder_batches(config: TrainConfig, microbatches: int, start: int) -> Iterator[StepBatch]:
    """``--model-dir``'s batches: ``--data`` tokenized by the folder's tokenizer (from the data
    cache) and packed per step by ``app.data``; micro-batches balanced by their cost
    (``length_cost``) with ``--microbatch-balance length``; with ``--global-batch-tokens``, each
    step of its own count of micro-batches (``step_budget``)."""
    from pipetrain.app.data import BatchShape
    from pipetrain.app.data import train_batches as packed

    shape = BatchShape(config.dp, microbatches, config.microbatch_size)
    cost, budget = length_cost(config)[0], step_budget(config)
    corpus = folder_corpus(config, training_data(config))
    options, seed = data_options(config), config.seed
    for b in packed(corpus, options, shape, seed=seed, start=start, cost=cost, budget=budget):
        count = b.microbatches if budget is not None else None
        yield StepBatch(b.inputs, b.targets, b.side, b.real_tokens, b.padding_tokens, count)


def length_cost(config: TrainConfig) -> tuple[LengthCost, str]:
    """What a document of ``n`` tokens costs when micro-batches are balanced, and a line
    saying which: the per-token and per-token² coefficients ``pipetrain profile --seq-lens``
    fitted into ``--costs FILE`` (every layer's summed, ms), else a transformer of the folder's
    width (``transformer_cost``: Megatron-LM's FLOP count)."""
    from pipetrain.app.data import transformer_cost

    if config.costs is None:
        hidden = run_shape(config).hidden
        return transformer_cost(hidden), f"micro-batches balanced by FLOPs (hidden {hidden})"
    from pipetrain.planner.costs_file import load_costs
    from pipetrain.planner.varlen import model_length_cost

    try:
        cost = model_length_cost(load_costs(config.costs))
    except ValueError as e:
        raise ValueError(f"--costs {config.costs}: {e}") from None
    line = (
        f"micro-batches balanced by the length costs in {config.costs}: "
        f"{cost.per_token:.3g} ms per token + {cost.per_token_sq:.3g} ms per token²"
    )
    return cost, line


def step_budget(config: TrainConfig) -> TokenBudget | None:
    """``--global-batch-tokens`` as a ``TokenBudget`` over the schedule's accepted counts
    (None without it)."""
    if config.global_batch_tokens is None:
        return None
    from pipetrain.app.config import DEFAULT_RANKS, DEFAULT_SCHEDULE
    from pipetrain.app.data import StepCounts, TokenBudget

    ranks = config.ranks or DEFAULT_RANKS
    counts = StepCounts(config.schedule or DEFAULT_SCHEDULE, ranks, config.stages_per_rank)
    try:
        return TokenBudget(
            config.global_batch_tokens,
            counts,
            dp=config.dp,
            microbatch_size=config.microbatch_size,
            seq_len=config.seq_len,
        )
    except ValueError as e:
        raise ValueError(f"--global-batch-tokens: {e}") from None


def training_data(config: TrainConfig) -> str:
    """``--data``, else the generated corpus (written first if missing)."""
    return str(text_path(config))


def data_options(config: TrainConfig) -> DataOptions:
    """How ``--model-dir``'s data becomes rows, from the run's flags."""
    from pipetrain.app.data import DataOptions

    return DataOptions(
        seq_len=config.seq_len,
        text_unit=config.text_unit,
        long_documents=config.long_documents,
        packing=config.packing,
        balanced=config.microbatch_balance == "length",
    )


def folder_corpus(config: TrainConfig, path: str) -> TokenCorpus:
    """``path`` tokenized by the ``--model-dir`` tokenizer, from ``--data-cache`` (built there
    first, under a lock, when missing)."""
    from pipetrain.app.data import prepare

    assert config.model_dir is not None
    return prepare(path, config.model_dir, data_options(config), cache_dir=config.data_cache)


def check_folder_data(config: TrainConfig, vocab: int) -> list[str]:
    """The launcher's check of ``--data`` and ``--eval-data`` for ``--model-dir``: each
    tokenized once into the cache (the workers find it there) and its token ids within the
    model's ``vocab``; the lines to print about them."""
    lines = []
    for path in (training_data(config), config.eval_data):
        if path is not None:
            corpus = folder_corpus(config, path)
            corpus.check_vocabulary(vocab, str(config.model_dir))
            lines.append(corpus.report.describe())
    return lines


def eval_batches(config: TrainConfig, folder: bool, rows: int) -> list[StepBatch]:
    """``--eval-data`` as batches of ``rows`` rows, every row once, targets aligned with the
    logits (see the module docstring); ``folder``: tokenized as ``--model-dir`` rows."""
    import torch

    assert config.eval_data is not None
    if folder:
        from pipetrain.app.data import BatchShape
        from pipetrain.app.data import eval_batches as packed

        corpus = folder_corpus(config, config.eval_data)
        shape = BatchShape(1, 1, rows)  # the rows in order: each replica slices its own
        batches = packed(corpus, data_options(config), shape)
        return [StepBatch(b.inputs, b.targets, b.side, b.predicted_tokens) for b in batches]
    data = bytearray(open(config.eval_data, "rb").read())
    tokens = torch.frombuffer(data, dtype=torch.uint8).long() if data else torch.zeros(0)
    width = config.seq_len
    count = (tokens.numel() - 1) // width
    if count < 1:
        raise ValueError(
            f"--eval-data {config.eval_data} has {tokens.numel()} bytes: one row of --seq-len "
            f"{width} and its next byte needs at least {width + 1}"
        )
    starts = torch.arange(count)[:, None] * width + torch.arange(width + 1)
    windows = tokens[starts]
    ids, targets = windows[:, :-1], windows[:, 1:].clone()
    fill = -len(ids) % rows
    if fill:
        ids = torch.cat([ids, ids[:1].expand(fill, -1)])
        targets = torch.cat([targets, torch.full_like(targets[:1], IGNORE_INDEX).expand(fill, -1)])
    out = []
    for start in range(0, len(ids), rows):
        part = slice(start, start + rows)
        predicted = int((targets[part] != IGNORE_INDEX).sum())
        out.append(StepBatch(ids[part], targets[part], {}, predicted))
    return out


__all__ = ["IGNORE_INDEX", "StepBatch", "eval_batches", "train_batches"]
