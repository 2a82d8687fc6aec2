"""``DataOptions``: how a data file becomes training rows, checked once where it is made.

The fields are the choices a user makes about the data (each one a flag of ``pipetrain train``
once the launcher wires it); everything else (the tokenizer, the cache folder, the batch shape)
is passed to the functions that need it. Which fields change the cached tokens is decided here
too (``cache_fields``), so the cache key and the options cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

TextUnit = Literal["line", "paragraph"]
LongDocuments = Literal["split", "refuse"]
Packing = Literal["documents", "none"]


@dataclass(frozen=True, kw_only=True)
class DataOptions:
    """How documents are cut, cached and packed.

    * ``seq_len`` — tokens per row.
    * ``text_unit`` — a ``.txt`` file's document: each non-blank ``"line"``, or each
      blank-line-separated ``"paragraph"``.
    * ``long_documents`` — a document longer than ``seq_len``: ``"split"`` into pieces of
      ``seq_len`` tokens, or ``"refuse"`` (a ``ValueError`` naming the record).
    * ``packing`` — ``"documents"``: several documents per row, each with position ids from 0
      and no token attending across documents; ``"none"``: one document per row, right-padded,
      with an ``attention_mask``.
    * ``balanced`` — rows and micro-batches filled by length-aware packing
      (``pipetrain.planner.varlen.pack_step``), else in stream order.
    """

    seq_len: int
    text_unit: TextUnit = "line"
    long_documents: LongDocuments = "split"
    packing: Packing = "documents"
    balanced: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.seq_len, int) or self.seq_len < 2:
            raise ValueError(f"seq_len must be an integer >= 2, got {self.seq_len!r}")
        for name, kind in (
            ("text_unit", TextUnit),
            ("long_documents", LongDocuments),
            ("packing", Packing),
        ):
            legal = get_args(kind)
            if getattr(self, name) not in legal:
                raise ValueError(
                    f"{name} {getattr(self, name)!r} is not one of {', '.join(map(repr, legal))}"
                )

    def cache_fields(self, plain_text: bool) -> dict[str, object]:
        """The options that change the cached tokens: the text unit of a ``.txt`` file, and
        ``seq_len`` when long documents are split at it (``plain_text``: the source is a
        ``.txt`` file). Packing and balancing act after the cache and do not enter it."""
        fields: dict[str, object] = {"long_documents": self.long_documents}
        if plain_text:
            fields["text_unit"] = self.text_unit
        if self.long_documents == "split":
            fields["seq_len"] = self.seq_len
        return fields
