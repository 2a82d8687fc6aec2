"""Records tokenized into documents: token ids, and for chats a loss mask on the assistant's
tokens.

A plain text is tokenized as ``tokenizer(text)`` does it, so it starts with BOS exactly where the
tokenizer adds one; a chat is rendered by the tokenizer's chat template (``apply_chat_template``),
which decides its special tokens. Either then ends with EOS (``eos_token_id`` appended when the
tokenizer did not end it so): a model fine-tuned on the documents learns to stop.

The assistant's tokens are found from the rendering, not from ``{% generation %}`` markers (which
``transformers``' ``return_assistant_tokens_mask`` needs and most templates lack): for each
assistant turn, the conversation before it rendered with the generation prompt and the
conversation through it are both prefixes of the whole rendering; the characters between them are
the turn (its end-of-turn marker included, so the model learns to end a turn), and a token is
the assistant's when it starts inside one (the fast tokenizer's offsets). A template that renders
an earlier turn differently once later turns follow (one that drops past reasoning, say) gives no
such prefixes and is refused rather than masked wrongly.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipetrain.app.data.sources import Place, Record

#: records tokenized per call of the tokenizer (fast tokenizers batch a call's texts)
CHUNK = 512
#: the files that make a tokenizer in a model folder; they key the token cache
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
#: files that alone hold a tokenizer's vocabulary
_VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass(frozen=True)
class Document:
    """One tokenized record: ``ids`` (uint32), and ``loss_mask`` (uint8, 1 where the token is a
    target to learn) or ``None`` when every token is; ``where`` names the record."""

    where: Place
    ids: np.ndarray
    loss_mask: np.ndarray | None


def load_tokenizer(folder: str | Path) -> Any:
    """The tokenizer of a model folder (``transformers``' ``AutoTokenizer``), fast only: the
    assistant masks need its character offsets."""
    folder = Path(folder)
    if not any((folder / name).is_file() for name in _VOCABULARY_FILES):
        raise ValueError(
            f"{folder} has no tokenizer (none of {', '.join(_VOCABULARY_FILES)}): copy the "
            "model's tokenizer files into it"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{folder}: its tokenizer cannot be loaded ({e})") from None
    if not tokenizer.is_fast:
        raise ValueError(
            f"{folder}: its tokenizer is not a fast one (no tokenizer.json); save it with "
            "transformers' AutoTokenizer(..., use_fast=True).save_pretrained"
        )
    return tokenizer


def tokenize(records: Iterable[Record], tokenizer: Any) -> Iterator[Document]:
    """Each record as a ``Document``, in order; plain texts are tokenized ``CHUNK`` at a time."""
    texts: list[Record] = []
    for record in records:
        if record.text is not None:
            texts.append(record)
            if len(texts) == CHUNK:
                yield from _texts(texts, tokenizer)
                texts = []
            continue
        yield from _texts(texts, tokenizer)
        texts = []
        yield chat_document(record, tokenizer)
    yield from _texts(texts, tokenizer)


def _texts(records: list[Record], tokenizer: Any) -> Iterator[Document]:
    if not records:
        return
    encoded = tokenizer([r.text for r in records], verbose=False)["input_ids"]
    for record, ids in zip(records, encoded):
        yield Document(record.where, _with_eos(ids, tokenizer), None)


def _with_eos(ids: list[int], tokenizer: Any) -> np.ndarray:
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos):
        ids = [*ids, eos]
    return np.asarray(ids, dtype=np.uint32)


def chat_document(record: Record, tokenizer: Any) -> Document:
    """A chat rendered by the tokenizer's template, its loss mask 1 on the assistant's turns (and
    on an EOS appended after a final assistant turn)."""
    assert record.messages is not None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{record.where} is a chat ('messages') but the tokenizer has no chat template: add "
            "one to the model folder (chat_template.jinja) or give 'text' records"
        )
    messages = list(record.messages)
    whole = _render(tokenizer, messages, record.where)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:turn], record.where, prompt=True)
        through = _render(tokenizer, messages[: turn + 1], record.where)
        if not (whole.startswith(through) and through.startswith(start)):
            raise ValueError(
                f"{record.where}: the chat template renders turn {turn} differently once later "
                "turns follow, so the assistant's tokens cannot be found; give 'text' records"
            )
        spans.append((len(start), len(through)))
    encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    starts = np.asarray([a for a, _ in encoded["offset_mapping"]], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    ids = _with_eos(encoded["input_ids"], tokenizer)
    if len(ids) > len(mask):  # the appended EOS ends the conversation: learnt after an answer
        last = 1 if messages[-1]["role"] == "assistant" else 0
        mask = np.append(mask, np.uint8(last))
    return Document(record.where, ids, mask)


def _render(tokenizer: Any, messages: list[dict[str, str]], where: Place, prompt: bool = False):
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
    except Exception as e:  # the template's own checks (jinja raise_exception) land here
        raise ValueError(f"{where}: the chat template refuses this conversation ({e})") from None


def split(document: Document, seq_len: int) -> Iterator[Document]:
    """``document`` cut into pieces of at most ``seq_len`` tokens, in order."""
    for start in range(0, len(document.ids), seq_len):
        mask = document.loss_mask
        yield Document(
            document.where,
            document.ids[start : start + seq_len],
            None if mask is None else mask[start : start + seq_len],
        )


def predicts_anything(document: Document) -> bool:
    """Whether some token of ``document`` after its first is a target: a document of one token,
    or a chat without an assistant turn, trains nothing and is not kept."""
    if len(document.ids) < 2:
        return False
    return document.loss_mask is None or bool(document.loss_mask[1:].any())
