"""The token cache: a data file tokenized once, then memory-mapped by every process.

``prepare`` is what a launcher calls before any worker starts: it checks the data and the
options, tokenizes the data into the cache unless it is there already, and returns the corpus
with a ``CacheReport`` for the caller to print. Workers call it again and find the cache.

The cache lives in ``cache_dir`` (default ``$XDG_CACHE_HOME/pipetrain/data``, else
``~/.cache/pipetrain/data``), one folder per key: a hash of the data's bytes (every file of a
``datasets`` folder), the tokenizer's files, the versions of ``transformers`` and ``tokenizers``,
and the options that change the tokens (``DataOptions.cache_fields``). A folder holds

* ``tokens.u32`` — every document's token ids, end to end (uint32);
* ``offsets.i64`` — where each document starts, and the end (int64, documents + 1 entries);
* ``numbers.i64`` — the record each document came from (its line or row number), for errors;
* ``loss_mask.u8`` — 1 where a token is a target to learn, when some document has a mask;
* ``meta.json`` — the counts and where the data came from; written last.

One process builds a folder, under an ``fcntl.flock`` lock on ``<key>.lock``, into a temporary
folder renamed into place when complete: a crash leaves no half cache that loads (the next
builder removes its remains), and a process that waited for the lock finds the finished folder.
Documents stream from the source through the tokenizer to the files; the corpus is never held
whole in memory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipetrain.app.data.data_options import DataOptions
from pipetrain.app.data.documents import (
    TOKENIZER_FILES,
    Document,
    load_tokenizer,
    predicts_anything,
    split,
    tokenize,
)
from pipetrain.app.data.sources import check_path, is_plain_text, read_records

#: bumped when the folder's layout changes, so an old cache is rebuilt rather than misread
CACHE_FORMAT = 1


@dataclass(frozen=True)
class CacheReport:
    """What ``prepare`` found or made: the ``folder``, whether this call ``built`` it and how many
    ``seconds`` tokenization took then, the ``documents`` and ``tokens`` kept, the documents
    ``dropped`` (nothing to predict) and the records ``split`` at ``seq_len``."""

    folder: Path
    built: bool
    seconds: float
    documents: int
    tokens: int
    dropped: int
    split: int

    def describe(self) -> str:
        """One line for the launcher to print."""
        how = f"tokenized in {self.seconds:.1f} s" if self.built else "cached"
        extra = [f"{self.dropped} dropped (nothing to predict)"] if self.dropped else []
        extra += [f"{self.split} long records split"] if self.split else []
        tail = f" ({', '.join(extra)})" if extra else ""
        return f"data: {self.documents} documents, {self.tokens} tokens, {how}{tail}: {self.folder}"


@dataclass(frozen=True)
class TokenCorpus:
    """A cached corpus, memory-mapped: document ``i`` is ``tokens[offsets[i]:offsets[i+1]]``,
    its targets masked by ``loss_mask`` (``None``: every token counts)."""

    tokens: np.ndarray
    offsets: np.ndarray
    numbers: np.ndarray
    loss_mask: np.ndarray | None
    #: where the documents came from (the data path) and what a number counts ("line", "row")
    source: str
    unit: str
    #: the id a padded position holds (its value is never attended to or learnt)
    pad_token_id: int
    max_token_id: int
    report: CacheReport

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        """Each document's token count (int64)."""
        return np.diff(self.offsets)

    def document(self, index: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Document ``index``'s ids and loss mask (views of the mapped files)."""
        a, b = int(self.offsets[index]), int(self.offsets[index + 1])
        mask = None if self.loss_mask is None else self.loss_mask[a:b]
        return self.tokens[a:b], mask

    def check_vocabulary(self, vocab: int, model: str) -> None:
        """``ValueError`` unless every token id is below ``vocab``, the size of ``model``'s
        embedding: a tokenizer that is not the model's would index past it."""
        if self.max_token_id >= vocab:
            raise ValueError(
                f"the tokenizer gives {self.source} token id {self.max_token_id}, but the model "
                f"{model} has {vocab} embeddings: is the tokenizer the model's?"
            )

    def where(self, index: int) -> str:
        """Document ``index``'s record, as errors name it (``"FILE line 12"``)."""
        return f"{self.source} {self.unit} {int(self.numbers[index])}"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pipetrain/data``, else ``~/.cache/pipetrain/data``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pipetrain" / "data"


def prepare(
    data: str | Path,
    tokenizer_dir: str | Path,
    options: DataOptions,
    cache_dir: str | Path | None = None,
) -> TokenCorpus:
    """The corpus of ``data`` tokenized by ``tokenizer_dir``'s tokenizer, from the cache (built
    first if missing); ``ValueError`` naming the file and record for bad data (see the package
    docstring for the list)."""
    path = check_path(data)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    name = f"{path.stem or 'data'}-{cache_key(path, Path(tokenizer_dir), options)}"
    folder = root / name
    built, seconds = False, 0.0
    if not (folder / "meta.json").is_file():
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"the data cache folder {root} cannot be made ({e})") from None
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            if not (folder / "meta.json").is_file():
                t0 = time.perf_counter()
                _build(path, Path(tokenizer_dir), options, root, name)
                built, seconds = True, time.perf_counter() - t0
    corpus = open_corpus(folder, built, seconds)
    if options.long_documents == "refuse":
        _refuse_long(corpus, options.seq_len)
    return corpus


def cache_key(path: Path, tokenizer_dir: Path, options: DataOptions) -> str:
    """The hash naming ``path``'s cache folder (see the module docstring)."""
    import tokenizers
    import transformers

    digest = hashlib.sha256()
    fields = {
        "format": CACHE_FORMAT,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        **options.cache_fields(is_plain_text(path)),
    }
    digest.update(json.dumps(fields, sort_keys=True).encode())
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for file in files:
        _hash_file(digest, file.relative_to(path).as_posix() if path.is_dir() else "data", file)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            _hash_file(digest, f"tokenizer/{name}", tokenizer_dir / name)
    return digest.hexdigest()[:24]


def _hash_file(digest, label: str, file: Path) -> None:
    digest.update(f"\0{label}\0{file.stat().st_size}\0".encode())
    with file.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)


def _build(path: Path, tokenizer_dir: Path, options: DataOptions, root: Path, name: str) -> None:
    """Tokenize ``path`` into ``root/name`` through a temporary folder (the caller holds the
    lock)."""
    for stale in root.glob(f"{name}.partial-*"):  # a crashed builder's remains
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f"{name}.partial-{os.getpid()}"
    tmp.mkdir()
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
        documents = tokenize(read_records(path, options.text_unit), tokenizer)
        counts = _write(_kept(documents, options), tmp)
        if counts["documents"] == 0:
            raise ValueError(
                f"{path} holds no documents with a token to predict (every record is empty, "
                "one token long, or a chat without an assistant turn)"
            )
        pad = tokenizer.pad_token_id
        pad = pad if pad is not None else (tokenizer.eos_token_id or 0)
        meta = {"format": CACHE_FORMAT, "source": str(path), "pad_token_id": int(pad), **counts}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        tmp.rename(root / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _kept(documents: Iterator[Document], options: DataOptions) -> Iterator[tuple[Document, int]]:
    """The documents to cache, each with how many pieces its record was cut into."""
    for document in documents:
        if options.long_documents == "split" and len(document.ids) > options.seq_len:
            pieces = list(split(document, options.seq_len))
        else:
            pieces = [document]
        for piece in pieces:
            yield piece, len(pieces)


def _write(documents: Iterator[tuple[Document, int]], folder: Path) -> dict[str, object]:
    """Stream ``documents`` into ``folder``'s files; the counts ``meta.json`` records."""
    count = tokens = dropped = split_records = top = 0
    unit, masked = "line", False
    with ExitStack() as files:
        ids, offsets, numbers, mask = (
            files.enter_context((folder / f).open("wb"))
            for f in ("tokens.u32", "offsets.i64", "numbers.i64", "loss_mask.u8")
        )
        offsets.write(np.int64(0).tobytes())
        previous = None
        for document, pieces in documents:
            if pieces > 1 and document.where != previous:
                split_records += 1
            previous = document.where
            if not predicts_anything(document):
                dropped += 1
                continue
            unit = document.where.unit
            ids.write(document.ids.tobytes())
            tokens += len(document.ids)
            offsets.write(np.int64(tokens).tobytes())
            numbers.write(np.int64(document.where.number).tobytes())
            masked |= document.loss_mask is not None
            ones = np.ones(len(document.ids), dtype=np.uint8)
            mask.write((ones if document.loss_mask is None else document.loss_mask).tobytes())
            top = max(top, int(document.ids.max()))
            count += 1
    if not masked:
        (folder / "loss_mask.u8").unlink()
    return {
        "documents": count,
        "tokens": tokens,
        "dropped": dropped,
        "split": split_records,
        "unit": unit,
        "loss_mask": masked,
        "max_token_id": top,
    }


def open_corpus(folder: Path, built: bool = False, seconds: float = 0.0) -> TokenCorpus:
    """A finished cache folder, memory-mapped read-only."""
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("format") != CACHE_FORMAT:
        raise ValueError(f"{folder} is a data cache of another format; delete it to rebuild")

    def mapped(name: str, dtype: type) -> np.ndarray:
        return np.memmap(folder / name, dtype=dtype, mode="r")

    report = CacheReport(
        folder, built, seconds, meta["documents"], meta["tokens"], meta["dropped"], meta["split"]
    )
    return TokenCorpus(
        tokens=mapped("tokens.u32", np.uint32),
        offsets=mapped("offsets.i64", np.int64),
        numbers=mapped("numbers.i64", np.int64),
        loss_mask=mapped("loss_mask.u8", np.uint8) if meta["loss_mask"] else None,
        source=meta["source"],
        unit=meta["unit"],
        pad_token_id=meta["pad_token_id"],
        max_token_id=meta["max_token_id"],
        report=report,
    )


def _refuse_long(corpus: TokenCorpus, seq_len: int) -> None:
    lengths = corpus.lengths
    long = np.flatnonzero(lengths > seq_len)
    if len(long):
        first = int(long[0])
        raise ValueError(
            f"{corpus.where(first)} has {int(lengths[first])} tokens, more than seq_len "
            f"{seq_len} ({len(long)} such documents): split them (long_documents='split') or "
            "raise seq_len"
        )
