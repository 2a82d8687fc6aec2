"""The token cache: built once and reused, keyed by what changes the tokens, one cache when two
preparations race, and nothing loadable left by a crash."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from data_cases import write_tokenizer

from pipetrain.app.data import DataOptions, default_cache_dir, prepare, token_cache

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("one\ntwo three\n\nfour\n")
    return path


def folders(cache):
    return sorted(p.name for p in cache.iterdir() if p.is_dir())


def counting(monkeypatch) -> list[int]:
    """Count the calls of the tokenization step."""
    calls: list[int] = []
    real = token_cache.tokenize

    def tokenize(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(token_cache, "tokenize", tokenize)
    return calls


def test_the_second_call_reuses_the_cache(tok_dir, text, tmp_path, monkeypatch):
    calls = counting(monkeypatch)
    options = DataOptions(seq_len=16)
    first = prepare(text, tok_dir, options, cache_dir=tmp_path / "c")
    second = prepare(text, tok_dir, options, cache_dir=tmp_path / "c")
    assert calls == [1]
    assert first.report.built and not second.report.built
    assert second.report.folder == first.report.folder
    assert np.array_equal(first.tokens, second.tokens)
    assert isinstance(second.tokens, np.memmap)
    assert "3 documents" in first.report.describe() and "tokenized" in first.report.describe()
    assert "cached" in second.report.describe()


def test_what_changes_the_tokens_changes_the_key(tok_dir, text, tmp_path):
    cache = tmp_path / "c"
    options = DataOptions(seq_len=16)
    prepare(text, tok_dir, options, cache_dir=cache)
    prepare(text, tok_dir, DataOptions(seq_len=16, packing="none", balanced=False), cache_dir=cache)
    assert len(folders(cache)) == 1  # packing does not change the tokens
    prepare(text, write_tokenizer(tmp_path / "other", bos=False), options, cache_dir=cache)
    assert len(folders(cache)) == 2
    prepare(text, tok_dir, DataOptions(seq_len=8), cache_dir=cache)  # split at another length
    assert len(folders(cache)) == 3
    prepare(text, tok_dir, DataOptions(seq_len=16, text_unit="paragraph"), cache_dir=cache)
    assert len(folders(cache)) == 4
    text.write_text("one\ntwo three\n\nfive\n")
    changed = prepare(text, tok_dir, options, cache_dir=cache)
    assert len(folders(cache)) == 5 and changed.report.built


def test_refusing_long_documents_does_not_depend_on_seq_len(tok_dir, text, tmp_path):
    cache = tmp_path / "c"
    prepare(text, tok_dir, DataOptions(seq_len=16, long_documents="refuse"), cache_dir=cache)
    again = prepare(
        text, tok_dir, DataOptions(seq_len=32, long_documents="refuse"), cache_dir=cache
    )
    assert not again.report.built and len(folders(cache)) == 1


def test_two_preparations_at_once_make_one_cache(tok_dir, text, tmp_path, monkeypatch):
    calls = counting(monkeypatch)
    results: list = []
    start = threading.Barrier(2)

    def run():
        start.wait()
        results.append(prepare(text, tok_dir, DataOptions(seq_len=16), cache_dir=tmp_path / "c"))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2 and calls == [1]
    assert sorted(r.report.built for r in results) == [False, True]
    assert len(folders(tmp_path / "c")) == 1
    assert np.array_equal(results[0].tokens, results[1].tokens)


def test_a_crash_leaves_no_cache_and_the_next_build_cleans_up(tok_dir, text, tmp_path, monkeypatch):
    cache = tmp_path / "c"

    def broken(documents, folder):
        (folder / "tokens.u32").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(token_cache, "_write", broken)
    with pytest.raises(KeyboardInterrupt):
        prepare(text, tok_dir, DataOptions(seq_len=16), cache_dir=cache)
    assert folders(cache) == []
    monkeypatch.undo()
    # a builder killed outright leaves its temporary folder: never loaded, removed by the next
    name = f"a-{token_cache.cache_key(text, tok_dir, DataOptions(seq_len=16))}"
    (cache / f"{name}.partial-1").mkdir()
    corpus = prepare(text, tok_dir, DataOptions(seq_len=16), cache_dir=cache)
    assert corpus.report.built and folders(cache) == [name]


def test_the_default_cache_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "pipetrain" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "pipetrain" / "data"


def test_a_datasets_folder_is_keyed_by_its_files(tok_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    cache = tmp_path / "c"
    datasets.Dataset.from_list([{"text": "ab"}]).save_to_disk(str(tmp_path / "d"))
    first = prepare(tmp_path / "d", tok_dir, DataOptions(seq_len=8), cache_dir=cache)
    datasets.Dataset.from_list([{"text": "abc"}]).save_to_disk(str(tmp_path / "d"))
    second = prepare(tmp_path / "d", tok_dir, DataOptions(seq_len=8), cache_dir=cache)
    assert second.report.built and second.report.folder != first.report.folder
    assert second.report.tokens == first.report.tokens + 1
