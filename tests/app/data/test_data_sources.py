"""Documents from every format: what each record becomes (BOS, EOS, the assistant mask), and the
one-line error each malformed input gives."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_cases import chat, tokenizer, write_jsonl, write_tokenizer

from pipetrain.app.data import DataOptions, prepare

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


def documents(corpus) -> list[list[int]]:
    return [corpus.document(i)[0].tolist() for i in range(len(corpus))]


def load(path, tok_dir, tmp_path, **options):
    options.setdefault("seq_len", 64)
    return prepare(path, tok_dir, DataOptions(**options), cache_dir=tmp_path / "cache")


def test_text_lines_and_paragraphs_start_with_bos_and_end_with_eos(tok_dir, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("one two\nthree\n\n  \nfour\nfive six\n")
    tok = tokenizer()
    lines = documents(load(text, tok_dir, tmp_path))
    expected = ["one two", "three", "four", "five six"]
    assert lines == [tok(t)["input_ids"] + [tok.eos_token_id] for t in expected]
    assert all(ids[0] == tok.bos_token_id for ids in lines)
    paragraphs = documents(load(text, tok_dir, tmp_path, text_unit="paragraph"))
    expected = ["one two\nthree", "four\nfive six"]
    assert paragraphs == [tok(t)["input_ids"] + [tok.eos_token_id] for t in expected]


def test_no_bos_where_the_tokenizer_adds_none(tmp_path):
    folder = write_tokenizer(tmp_path / "plain", bos=False)
    text = tmp_path / "a.txt"
    text.write_text("abc\n")
    tok = tokenizer(bos=False)
    assert documents(load(text, folder, tmp_path)) == [tok("abc")["input_ids"] + [3]]
    assert tok("abc")["input_ids"][0] != tok.bos_token_id


def test_chat_loss_mask_covers_the_assistant_turns_only(tok_dir, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", [chat("hi", "hello!", "sum 2 2", "4"), {"text": "x"}])
    corpus = load(data, tok_dir, tmp_path)
    tok = tokenizer()
    ids, mask = corpus.document(0)
    messages = chat("hi", "hello!", "sum 2 2", "4")["messages"]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert ids.tolist() == tok(rendered, add_special_tokens=False)["input_ids"] + [3]
    learnt = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False).replace(" ", "")
    # each answer with its end-of-turn marker, and the EOS after the last answer
    assert learnt == "hello!<|end|>\n4<|end|>\n</s>"
    text_ids, text_mask = corpus.document(1)
    assert text_mask is not None and text_mask.all()  # a text record learns every token
    assert text_ids.tolist() == tok("x")["input_ids"] + [3]


def test_a_chat_without_an_assistant_turn_is_dropped(tok_dir, tmp_path):
    data = write_jsonl(tmp_path / "c.jsonl", [chat("only a question"), chat("q", "a")])
    corpus = load(data, tok_dir, tmp_path)
    assert len(corpus) == 1 and corpus.report.dropped == 1
    assert corpus.where(0) == f"{data} line 2"


def test_long_documents_are_split_into_seq_len_pieces(tok_dir, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("abcdefghijklmnopqrstuvwxyz\n")
    corpus = load(text, tok_dir, tmp_path, seq_len=8)
    whole = tokenizer()("abcdefghijklmnopqrstuvwxyz")["input_ids"] + [3]
    pieces = documents(corpus)
    assert [len(p) for p in pieces] == [8, 8, 8, 4]
    assert [t for p in pieces for t in p] == whole
    assert corpus.report.split == 1


def test_datasets_folder_parquet_and_json(tok_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"text": "ab"}, {"text": "cd e"}]
    table = datasets.Dataset.from_list(rows)
    table.save_to_disk(str(tmp_path / "saved"))
    table.to_parquet(str(tmp_path / "d.parquet"))
    (tmp_path / "d.json").write_text(json.dumps(rows))
    tok = tokenizer()
    expected = [tok(r["text"])["input_ids"] + [3] for r in rows]
    for path in (tmp_path / "saved", tmp_path / "d.parquet", tmp_path / "d.json"):
        assert documents(load(path, tok_dir, tmp_path)) == expected, path
    chats = datasets.Dataset.from_list([chat("q", "a")])
    chats.to_parquet(str(tmp_path / "chat.parquet"))
    corpus = load(tmp_path / "chat.parquet", tok_dir, tmp_path)
    assert corpus.loss_mask is not None and 0 < int(corpus.loss_mask.sum()) < len(corpus.tokens)


ERRORS = [
    ("bad.jsonl", '{"text": "a"}\n{"text": \n', "bad.jsonl line 2 is not JSON"),
    ("bad.jsonl", '{"text": "a"}\n\n{"body": "b"}\n', "line 3 has no 'text' or 'messages'"),
    ("bad.jsonl", '{"text": 5}\n', "line 1: 'text' must be a string, got int"),
    ("bad.jsonl", "[1, 2]\n", "line 1: expected a JSON object"),
    ("bad.jsonl", '{"messages": [{"role": "user"}]}\n', "messages[0] must be an object"),
    ("bad.jsonl", '{"messages": []}\n', "'messages' must be a non-empty list"),
    ("empty.txt", "\n  \n", "empty.txt holds no documents"),
    ("data.csv", "a,b\n", "unknown data format '.csv'"),
]


@pytest.mark.parametrize(("name", "content", "message"), ERRORS)
def test_malformed_data_is_refused_naming_the_record(tok_dir, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("?", r"\?")) as e:
        load(path, tok_dir, tmp_path)
    assert "\n" not in str(e.value)
    assert not [p for p in (tmp_path / "cache").glob("*") if p.is_dir()]  # no cache left


def test_chat_records_need_a_chat_template(tmp_path):
    folder = write_tokenizer(tmp_path / "nochat", chat=False)
    data = write_jsonl(tmp_path / "c.jsonl", [{"text": "a"}, chat("q", "a")])
    with pytest.raises(ValueError, match=r"c.jsonl line 2 is a chat .* has no chat template"):
        load(data, folder, tmp_path)


def test_long_documents_refused_when_asked(tok_dir, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("short\nmuch longer line\n")
    with pytest.raises(ValueError, match=r"a.txt line 2 has 18 tokens, more than seq_len 8"):
        load(text, tok_dir, tmp_path, seq_len=8, long_documents="refuse")
    assert len(load(text, tok_dir, tmp_path, seq_len=18, long_documents="refuse")) == 2


def test_missing_path_folder_and_options(tok_dir, tmp_path):
    with pytest.raises(ValueError, match="no such data file"):
        load(tmp_path / "nope.txt", tok_dir, tmp_path)
    (tmp_path / "plain").mkdir()
    with pytest.raises(ValueError, match="not one written by datasets' save_to_disk"):
        load(tmp_path / "plain", tok_dir, tmp_path)
    with pytest.raises(ValueError, match="text_unit 'word' is not one of 'line', 'paragraph'"):
        DataOptions(seq_len=8, text_unit="word")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="has no tokenizer"):
        (tmp_path / "a.txt").write_text("a\n")
        load(tmp_path / "a.txt", tmp_path / "plain", tmp_path)


def test_without_datasets_the_install_is_named(tok_dir, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets raises ImportError
    (tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"pip install 'pipetrain\[data\]'"):
        load(tmp_path / "d.parquet", tok_dir, tmp_path)


def test_token_ids_are_uint32_and_offsets_int64(tok_dir, tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("ab\n")
    corpus = load(text, tok_dir, tmp_path)
    assert corpus.tokens.dtype == np.uint32 and corpus.offsets.dtype == np.int64
    assert corpus.max_token_id == int(corpus.tokens.max())


def test_no_eos_is_appended_where_the_tokenizer_has_none(tmp_path):
    folder = write_tokenizer(tmp_path / "noeos", eos=False)
    text = tmp_path / "a.txt"
    text.write_text("abc\n")
    corpus = load(text, folder, tmp_path)
    assert documents(corpus) == [tokenizer(eos=False)("abc")["input_ids"]]
    corpus.check_vocabulary(corpus.max_token_id + 1, "m")
    with pytest.raises(ValueError, match="is the tokenizer the model's"):
        corpus.check_vocabulary(corpus.max_token_id, "m")


def test_datasets_errors_are_one_line(tok_dir, tmp_path):
    datasets = pytest.importorskip("datasets")
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list([{"text": "a"}])})
    splits.save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"holds the splits train; give one split's folder"):
        load(tmp_path / "splits", tok_dir, tmp_path)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"bad.parquet cannot be read by datasets") as e:
        load(tmp_path / "bad.parquet", tok_dir, tmp_path)
    assert "\n" not in str(e.value)
    datasets.Dataset.from_list([{"body": "a"}]).to_parquet(str(tmp_path / "body.parquet"))
    with pytest.raises(ValueError, match=r"no 'text' or 'messages' column \(its columns: body\)"):
        load(tmp_path / "body.parquet", tok_dir, tmp_path)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    folder = write_tokenizer(tmp_path / "rewrites")
    tok = tokenizer()
    # earlier answers shown as "x" once a later turn follows (as templates that drop reasoning do)
    tok.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>"
        "{% if m.role == 'assistant' and not loop.last %}x{% else %}{{ m.content }}{% endif %}"
        "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok.save_pretrained(folder)
    data = write_jsonl(tmp_path / "c.jsonl", [chat("q", "a", "q2", "a2")])
    with pytest.raises(ValueError, match=r"c.jsonl line 1: the chat template renders turn 1"):
        load(data, folder, tmp_path)
