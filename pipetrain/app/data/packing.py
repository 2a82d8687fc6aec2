"""Rows of tokens from documents: packed several to a row with their boundaries kept, or one to a
row and right-padded.

Packed (``packing="documents"``, as in Krell et al. 2021, "Efficient Sequence Packing without
Cross-contamination"): the documents of a row sit end to end, the rest of the row is padding.
``position_ids`` restart at 0 at each document (and at the padding), and no ``attention_mask``
is given, so ``transformers``' mask functions build a block-diagonal causal mask: no token sees
another document (``pipetrain/hf/masks.py``). A ``token_mask`` side input marks the
documents' tokens 1 and the padding 0, for what counts per token (a router's balancing loss, an
expert's load), not for attention. The target at position ``i`` is token ``i + 1``
only when that token is in the same document and its loss mask is 1; every other target
(a document's last token, the padding) is ``IGNORE_INDEX``.

Padded (``packing="none"``): one document per row, right-padded, with an ``attention_mask``
side input; the targets are ``pipetrain.hf.next_token_targets``' with the loss mask applied.

Which documents go to which row is decided elsewhere (``app.data.step_batches``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pipetrain.app.data.token_cache import TokenCorpus
from pipetrain.hf.masks import IGNORE_INDEX, next_token_targets


@dataclass(frozen=True)
class Rows:
    """A batch's rows: ``inputs`` and ``targets`` ``(rows, seq_len)`` int64, the ``side``
    inputs ``pipe.step`` takes, and the counts of document tokens (``real_tokens``), of targets
    not ignored (``predicted_tokens``) and of padded positions (``padding_tokens``)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    side: dict[str, torch.Tensor]
    real_tokens: int
    predicted_tokens: int
    padding_tokens: int


def packed_rows(corpus: TokenCorpus, rows: Sequence[Sequence[int]], seq_len: int) -> Rows:
    """Each row the documents of those indices end to end, then padding (see the module
    docstring); ``ValueError`` if a row's documents are longer than ``seq_len``."""
    inputs = np.full((len(rows), seq_len), corpus.pad_token_id, dtype=np.int64)
    targets = np.full((len(rows), seq_len), IGNORE_INDEX, dtype=np.int64)
    positions = np.zeros((len(rows), seq_len), dtype=np.int64)
    counted = np.zeros((len(rows), seq_len), dtype=np.int64)
    real = 0
    for r, row in enumerate(rows):
        at = 0
        for index in row:
            ids, mask = corpus.document(index)
            n = len(ids)
            if at + n > seq_len:
                raise ValueError(f"row {r}'s documents {list(row)} are longer than {seq_len}")
            inputs[r, at : at + n] = ids
            positions[r, at : at + n] = np.arange(n)
            follow = ids[1:].astype(np.int64)
            if mask is not None:
                follow = np.where(mask[1:] == 1, follow, IGNORE_INDEX)
            targets[r, at : at + n - 1] = follow
            at += n
        positions[r, at:] = np.arange(seq_len - at)  # the padding: one more "document"
        counted[r, :at] = 1
        real += at
    # which tokens per-token statistics count (a router's balancing loss, an expert's load):
    # the pad tail is a "document" to attention but no token
    side = {"position_ids": torch.from_numpy(positions), "token_mask": torch.from_numpy(counted)}
    return _rows(inputs, targets, side, real)


def padded_rows(corpus: TokenCorpus, documents: Sequence[int | None], seq_len: int) -> Rows:
    """One document per row (``None``: an empty row), right-padded, with an
    ``attention_mask``. An empty row attends to its first position, so that no query has
    nothing to attend to (a fully masked softmax row is NaN); it predicts nothing."""
    inputs = np.full((len(documents), seq_len), corpus.pad_token_id, dtype=np.int64)
    attend = np.zeros((len(documents), seq_len), dtype=np.int64)
    learn = np.ones((len(documents), seq_len), dtype=np.uint8)
    real = 0
    for r, index in enumerate(documents):
        if index is None:
            attend[r, 0] = 1
            learn[r] = 0
            continue
        ids, mask = corpus.document(index)
        n = len(ids)
        if n > seq_len:
            raise ValueError(f"document {index} has {n} tokens, longer than {seq_len}")
        inputs[r, :n] = ids
        attend[r, :n] = 1
        if mask is not None:
            learn[r, :n] = mask
        real += n
    input_ids, attention_mask = torch.from_numpy(inputs), torch.from_numpy(attend)
    targets = next_token_targets(input_ids, attention_mask=attention_mask)
    targets[:, :-1][torch.from_numpy(learn[:, 1:] == 0)] = IGNORE_INDEX
    return _rows(inputs, targets.numpy(), {"attention_mask": attention_mask}, real)


def _rows(inputs: np.ndarray, targets: np.ndarray, side: dict[str, torch.Tensor], real: int):
    return Rows(
        inputs=torch.from_numpy(inputs),
        targets=torch.from_numpy(targets),
        side=side,
        real_tokens=real,
        predicted_tokens=int((targets != IGNORE_INDEX).sum()),
        padding_tokens=inputs.size - real,
    )
