"""Where documents come from: a data file (or a ``datasets`` folder) read record by record.

A source yields ``Record``s, each a plain text or a chat conversation with the number that names
it in an error (a line of a ``.txt`` or ``.jsonl`` file, a row of a ``datasets`` table), one at a
time: the corpus is never held whole. Formats, by the path:

* ``*.txt`` — one document per non-blank line (``text_unit="line"``) or per blank-line-separated
  paragraph (``"paragraph"``, numbered by its first line).
* ``*.jsonl`` — one JSON object per line: ``{"text": str}`` or ``{"messages": [{"role": str,
  "content": str}, ...]}`` (a chat conversation, rendered later by the tokenizer's template).
* a folder written by ``datasets``' ``save_to_disk``, or ``*.parquet`` / ``*.json`` files read
  through ``datasets`` — rows with a ``text`` or a ``messages`` column, read the same way.

Tokenization is left to ``app.data.documents``; the cache, to ``app.data.token_cache``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipetrain.app.data.data_options import TextUnit

#: the formats read without ``datasets``, by suffix
PLAIN_SUFFIXES = (".txt", ".jsonl")
#: the formats ``datasets`` reads, by suffix, and its builder for each
DATASETS_SUFFIXES = {".parquet": "parquet", ".json": "json"}
INSTALL_DATASETS = "pip install 'pipetrain[data]'"


@dataclass(frozen=True)
class Place:
    """Where a record is: its ``source`` (the path), ``unit`` (``"line"`` of a text file,
    ``"row"`` of a table) and ``number`` (from 1); errors name it as ``"FILE line 12"``."""

    source: str
    unit: str
    number: int

    def __str__(self) -> str:
        return f"{self.source} {self.unit} {self.number}"


@dataclass(frozen=True)
class Record:
    """One document before tokenization: ``text``, or ``messages`` (a chat), and ``where`` it
    is."""

    where: Place
    text: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


def check_path(path: str | Path) -> Path:
    """The data path, checked: an existing file of a known format or a ``datasets`` folder."""
    data = Path(path)
    if data.is_dir():
        if (
            not (data / "dataset_info.json").is_file()
            and not (data / "dataset_dict.json").is_file()
        ):
            raise ValueError(
                f"{data} is a folder but not one written by datasets' save_to_disk (no "
                "dataset_info.json); give a .txt, .jsonl, .json or .parquet file, or such a folder"
            )
        return data
    if not data.is_file():
        raise ValueError(f"{data}: no such data file")
    legal = (*PLAIN_SUFFIXES, *DATASETS_SUFFIXES)
    if data.suffix not in legal:
        raise ValueError(
            f"{data}: unknown data format {data.suffix or '(no suffix)'!r}; give one of "
            f"{', '.join(legal)}, or a datasets folder"
        )
    return data


def is_plain_text(path: Path) -> bool:
    """Whether ``path`` is a ``.txt`` file (the only format whose ``text_unit`` matters)."""
    return path.is_file() and path.suffix == ".txt"


def read_records(path: Path, text_unit: TextUnit) -> Iterator[Record]:
    """Every record of ``path`` in file order (``ValueError`` at the first malformed one)."""
    if path.is_dir() or path.suffix in DATASETS_SUFFIXES:
        yield from _dataset_records(path)
    elif path.suffix == ".jsonl":
        yield from _jsonl_records(path)
    elif text_unit == "paragraph":
        yield from _paragraphs(path)
    else:
        with path.open(encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                text = line.rstrip("\r\n")
                if text.strip():
                    yield Record(Place(str(path), "line", number), text=text)


def _paragraphs(path: Path) -> Iterator[Record]:
    """Blank-line-separated paragraphs, their lines joined by newlines, numbered by their first
    line."""
    held: list[str] = []
    first = 0
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            text = line.rstrip("\r\n")
            if text.strip():
                first = first if held else number
                held.append(text)
            elif held:
                yield Record(Place(str(path), "line", first), text="\n".join(held))
                held = []
    if held:
        yield Record(Place(str(path), "line", first), text="\n".join(held))


def _jsonl_records(path: Path) -> Iterator[Record]:
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = Place(str(path), "line", number)
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{where} is not JSON ({e.msg}); each line must be one JSON object"
                ) from None
            yield record_of(value, where)


def record_of(value: Any, where: Place) -> Record:
    """A JSON object (or a ``datasets`` row) as a ``Record``: a ``text`` string, or a
    ``messages`` list of ``{"role": str, "content": str}`` objects; ``ValueError`` otherwise."""
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: expected a JSON object with 'text' or 'messages', got {type(value).__name__}"
        )
    text, messages = value.get("text"), value.get("messages")
    if text is not None and messages is not None:
        raise ValueError(f"{where} has both 'text' and 'messages'; give one of them")
    if text is not None:
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'text' must be a string, got {type(text).__name__}")
        return Record(where, text=text)
    if messages is None:
        keys = ", ".join(sorted(map(str, value))) or "none"
        raise ValueError(f"{where} has no 'text' or 'messages' field (its fields: {keys})")
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"{where}: 'messages' must be a non-empty list of {{'role', 'content'}} objects"
        )
    for i, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"{where}: messages[{i}] must be an object with string 'role' and 'content', "
                f"got {message!r:.80}"
            )
    return Record(
        where,
        messages=tuple({"role": m["role"], "content": m["content"]} for m in messages),
    )


def _dataset_records(path: Path) -> Iterator[Record]:
    """Rows of a ``datasets`` folder or of ``.parquet`` / ``.json`` files, read in batches."""
    try:
        import datasets  # type: ignore[import-untyped]
    except ImportError:
        raise ValueError(f"{path} is read with the datasets package: {INSTALL_DATASETS}") from None
    number = 0
    for batch in _batches(datasets, path):
        columns = [c for c in ("text", "messages") if c in batch]
        if not columns:
            found = ", ".join(batch) or "none"
            raise ValueError(f"{path} has no 'text' or 'messages' column (its columns: {found})")
        for i in range(len(batch[columns[0]])):
            number += 1
            row = {c: batch[c][i] for c in columns if batch[c][i] is not None}
            yield record_of(row, Place(str(path), "row", number))


def _batches(datasets: Any, path: Path) -> Iterator[dict[str, list[Any]]]:
    """The table's rows in column batches; what ``datasets`` cannot read is one ``ValueError``
    (its own errors vary, and some of pyarrow's are ``ValueError``s of many lines)."""
    try:
        if path.is_dir():
            table = datasets.load_from_disk(str(path))
        else:
            table = datasets.load_dataset(
                DATASETS_SUFFIXES[path.suffix], data_files=str(path), split="train", streaming=True
            )
    except Exception as e:
        raise _unreadable(path, e) from None
    if isinstance(table, datasets.DatasetDict):
        raise ValueError(
            f"{path} holds the splits {', '.join(table)}; give one split's folder "
            f"({path / next(iter(table))})"
        )
    batches = iter(table.iter(batch_size=512))
    while True:
        try:
            batch = next(batches, None)
        except Exception as e:
            raise _unreadable(path, e) from None
        if batch is None:
            return
        yield batch


def _unreadable(path: Path, error: Exception) -> ValueError:
    first = (str(error).strip().splitlines() or [""])[0]
    return ValueError(f"{path} cannot be read by datasets ({type(error).__name__}: {first})")
