"""Where ``pipetrain train`` gets its batches: one record per step for training, a fixed list of
records for evaluation, each carrying its own token counts.

A ``StepBatch`` is what the loop needs of a step's data: the inputs for stage 0, the targets for
the loss, side inputs by name (an attention mask), and how many of its tokens are real and how
many padding (the metrics count them from the record, not from a mask). ``train_batches`` reads
the training data as the loop always has — windows of a text file's bytes for the built-in
models, the ``--model-dir`` tokenizer's padded rows (``app.model_folder``) for a folder — and
``eval_batches`` reads ``--eval-data`` the same way but in order, every row once: byte windows
of ``--seq-len`` that overlap by one byte, so each byte after the first is predicted exactly
once, or the folder's padded rows. Evaluation targets are aligned with the logits (position t
predicts target t; -100 where nothing is predicted), whatever the model's training loss takes;
the last batch is filled up to the pipeline's batch size with copies of a row whose targets are
all -100, so it counts nothing.

These two functions are the only place the loop reads data, so another source (packed
documents, JSONL, chat) replaces them without touching the loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pipetrain.app.catalog import LayerModel
    from pipetrain.app.config import TrainConfig

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

    def rows(self, mine: slice, device: torch.device) -> StepBatch:
        """The rows ``mine`` (one replica's share) on ``device``; counts are the whole batch's."""
        return dataclasses.replace(
            self,
            inputs=self.inputs[mine].to(device),
            targets=self.targets[mine].to(device),
            side={k: v[mine].to(device) for k, v in self.side.items()},
        )


def train_batches(config: TrainConfig, model: LayerModel | None, rows: int) -> Iterator[StepBatch]:
    """Endless training batches of ``rows`` rows (every replica's), drawn from the seed and the
    step: windows of the text's bytes for the built-in ``model``, padded rows of the folder's
    tokens when ``model`` is None (``--model-dir``)."""
    if model is None:
        from pipetrain.app.model_folder import padded_batches

        for inputs, targets, side in padded_batches(config, rows):
            mask = side["attention_mask"]
            real = int(mask.sum())
            yield StepBatch(inputs, targets, side, real, mask.numel() - real)
        return
    from pipetrain.app.models.data import batches
    from pipetrain.app.train import read_tokens

    for window, shifted in batches(read_tokens(config), rows, config.seq_len, config.seed):
        inputs, targets = model.batch(window, shifted)
        yield StepBatch(inputs, targets, {}, window.numel(), 0)


def eval_batches(config: TrainConfig, folder: bool, rows: int) -> list[StepBatch]:
    """``--eval-data`` as batches of ``rows`` rows, every row once, targets aligned with the
    logits (see the module docstring); ``folder``: tokenized as ``--model-dir`` rows."""
    import torch

    assert config.eval_data is not None
    if folder:
        from pipetrain.app.model_folder import token_rows
        from pipetrain.hf import next_token_targets

        ids, mask = token_rows(dataclasses.replace(config, data=config.eval_data))
        targets = next_token_targets(ids, attention_mask=mask, ignore_index=IGNORE_INDEX)
        side = {"attention_mask": mask}
    else:
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
        ids, targets, side = windows[:, :-1], windows[:, 1:].clone(), {}
    fill = -len(ids) % rows
    if fill:
        ids = torch.cat([ids, ids[:1].expand(fill, -1)])
        targets = torch.cat([targets, torch.full_like(targets[:1], IGNORE_INDEX).expand(fill, -1)])
        side = {k: torch.cat([v, v[:1].expand(fill, -1)]) for k, v in side.items()}
    out = []
    for start in range(0, len(ids), rows):
        part = slice(start, start + rows)
        predicted = int((targets[part] != IGNORE_INDEX).sum())
        batch = StepBatch(ids[part], targets[part], {k: v[part] for k, v in side.items()})
        out.append(dataclasses.replace(batch, real_tokens=predicted))
    return out


__all__ = ["IGNORE_INDEX", "StepBatch", "eval_batches", "train_batches"]
