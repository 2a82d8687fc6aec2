"""Attention masks, position ids and packed documents for ``pipetrain.hf``'s layers, and the
next-token targets that count the right tokens.

A batch reaches the layers as ``pipe.step(input_ids, targets, side={...})`` with either or both
side inputs, each ``(rows, T)`` and split into micro-batches like the inputs:

* ``attention_mask`` — 1 for a token, 0 for padding (left or right). Without ``position_ids``
  positions are ``0..T-1`` as in ``transformers`` (whose ``forward`` does not derive them from
  the mask either).
* ``position_ids`` — positions restarting at 0 where a new document starts (several documents
  packed in one row). Given without ``attention_mask``, the mask is block-diagonal causal: a
  token sees only earlier tokens of its own document (``transformers`` finds the documents from
  the position ids). With an ``attention_mask`` too, ``transformers`` builds the padding mask
  and does not look for documents; the layers do the same.

Each decoder layer builds its 4-D mask (or ``BlockMask`` under FlexAttention, or ``None`` where
SDPA's own causal flag suffices) with ``transformers``' mask functions, from the same arguments
the unsplit ``forward`` passes them, so the mask is the model's whatever the attention
implementation the config names. The first layer of a stage that needs a mask (or a rotary
table) builds it and the next ones reuse it (``BuiltOnce``), as the model's own ``forward``
builds them once per call rather than once per layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any

import torch

from pipetrain.runtime.torch_compat import saved_tensors_hooked, version_of

IGNORE_INDEX = -100


def positions(hidden: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
    """The given position ids, else ``0..T-1`` (one row, broadcast over the batch), as the
    model's ``forward`` defaults them."""
    if position_ids is not None:
        return position_ids
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class BuiltOnce:
    """What the decoder layers of one model build alike from a micro-batch's side inputs — the
    attention mask, the rotary table — built by the first layer that asks and reused by the
    next. Each layer building its own would repeat the work per layer, and with a padding mask
    ``transformers``' SDPA mask builder waits for the device to learn whether any token is
    padding: once per layer and micro-batch instead of once.

    One value per kind of thing (``what``: a kind and the shapes it depends on) is kept, and
    reused only while every tensor it was built from is the same object, unchanged in place
    since (its version counter: a CUDA graph's static buffers are refilled in place); it is
    dropped when one of them is freed (the micro-batch's side inputs, at the end of a step) or
    replaced by the next micro-batch's. Built every time inside ``torch.compile`` (in the traced
    code, as ``transformers`` builds it there), where saved-tensor hooks are active (a
    checkpointed layer's recompute must run what its forward ran), during a CUDA graph capture
    (a replay must compute it, not read a tensor this cache may free) and for inference tensors
    (no version counter). Copies of a layer start empty."""

    def __init__(self) -> None:
        self._slots: dict[Hashable, tuple[tuple, tuple, Any]] = {}

    def __deepcopy__(self, memo: dict) -> BuiltOnce:
        return BuiltOnce()

    def __reduce__(self):
        return (BuiltOnce, ())

    def get(
        self, what: Hashable, sources: tuple[torch.Tensor | None, ...], build: Callable[[], Any]
    ):
        """``build()``, or the value the last call with the same ``what`` built, if it was built
        from these very ``sources`` (``None`` entries allowed), unchanged since."""
        given = [s for s in sources if s is not None]
        if (
            torch.compiler.is_compiling()
            or saved_tensors_hooked()
            or any(s.is_inference() for s in given)
            or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
        ):
            return build()
        ids = tuple(None if s is None else (id(s), version_of(s)) for s in sources)
        slot = self._slots.get(what)
        if slot is not None and slot[0] == ids and all(r() is s for r, s in zip(slot[1], given)):
            return slot[2]
        value = build()
        drop = _dropper(weakref.ref(self), what)
        self._slots[what] = (ids, tuple(weakref.ref(s, drop) for s in given), value)
        return value

    def _drop(self, what: Hashable, ref: weakref.ref) -> None:
        slot = self._slots.get(what)
        if slot is not None and any(r is ref for r in slot[1]):
            del self._slots[what]


def _dropper(owner: weakref.ref, what: Hashable) -> Callable[[weakref.ref], None]:
    """The callback that drops ``what``'s slot when a tensor it was built from is freed (holding
    its owner weakly: a freed layer's cache goes with it)."""

    def drop(ref: weakref.ref) -> None:
        cache = owner()
        if cache is not None:
            cache._drop(what, ref)

    return drop


def layer_mask(
    config: Any,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    sliding: bool,
):
    """The mask one decoder layer attends with: ``transformers``' causal or sliding-window mask
    for ``attention_mask`` (``(rows, T)`` padding, or a prepared 4-D mask) and ``position_ids``
    (given: packed documents where they restart). Only given ids are passed on: for ``0..T-1``
    ``transformers`` would look for restarts with a test that waits for the device, every layer
    and micro-batch, to find none."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    if attention_mask is not None and attention_mask.dim() == 2:
        if attention_mask.shape != hidden.shape[:2]:
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)} but the rows and "
                f"tokens are {tuple(hidden.shape[:2])}; give one 0/1 entry per token"
            )
    make = create_sliding_window_causal_mask if sliding else create_causal_mask
    return make(
        config=config,
        inputs_embeds=hidden,
        attention_mask=attention_mask,
        cache=None,
        position_ids=position_ids,
    )


def next_token_targets(
    labels: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Targets aligned with the logits: ``targets[:, t] = labels[:, t + 1]``, the last column
    ``ignore_index`` (``transformers`` pads the labels the same way before shifting).

    Also ignored: targets that are padding (``attention_mask`` 0 there) and, for packed rows,
    the first token of each document (``position_ids`` not continuing from the token before), which
    the previous document's last token must not be trained to predict. With these targets and
    ``pipetrain.hf.causal_lm_token_loss`` the pipeline's ``"token_mean"`` divides by the tokens
    that are really predicted, over the whole batch."""
    if labels.dim() != 2:
        raise ValueError(f"labels must be (rows, T) token ids, got shape {tuple(labels.shape)}")
    targets = torch.full_like(labels, ignore_index)
    targets[:, :-1] = labels[:, 1:]
    if attention_mask is not None:
        if attention_mask.shape != labels.shape:
            raise ValueError(
                f"attention_mask {tuple(attention_mask.shape)} and labels "
                f"{tuple(labels.shape)} differ in shape"
            )
        targets[:, :-1][attention_mask[:, 1:] == 0] = ignore_index
    if position_ids is not None:
        if position_ids.shape != labels.shape:
            raise ValueError(
                f"position_ids {tuple(position_ids.shape)} and labels {tuple(labels.shape)} "
                "differ in shape"
            )
        starts = position_ids[:, 1:] != position_ids[:, :-1] + 1
        targets[:, :-1][starts] = ignore_index
    return targets


def packed_position_ids(lengths: list[list[int]], seq_len: int) -> torch.Tensor:
    """Position ids of rows packed with documents of the given lengths (each row's lengths summing
    to at most ``seq_len``; what is left is counted as one more document): ``[[3, 2]], 5`` →
    ``[[0, 1, 2, 0, 1]]``."""
    rows = []
    for row in lengths:
        if sum(row) > seq_len or any(n < 1 for n in row):
            raise ValueError(f"document lengths {row} do not fit a row of {seq_len} tokens")
        rest = seq_len - sum(row)
        rows.append([i for n in [*row, *([rest] if rest else [])] for i in range(n)])
    return torch.tensor(rows)
