"""What the data tests share: a tiny character-level tokenizer written to a folder (no
downloads), with BOS added to plain text, an EOS token and a chat template; and data files."""

from __future__ import annotations

import json
from pathlib import Path

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-:\n"
SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer(bos: bool = True, chat: bool = True, eos: bool = True):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL)}
    vocab.update({c: len(SPECIAL) + i for i, c in enumerate(CHARS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", 2)]
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>" if eos else None,
        additional_special_tokens=SPECIAL[4:],
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def write_tokenizer(folder: Path, **kinds: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer(**kinds).save_pretrained(folder)
    return folder


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def chat(*turns: str) -> dict:
    """A conversation alternating user and assistant turns."""
    roles = ["user", "assistant"]
    return {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}


VOCAB = len(SPECIAL) + len(CHARS)


def corpus_of(documents: list[list[int]], masks: list[list[int]] | None = None, pad: int = 1):
    """A ``TokenCorpus`` held in memory, as the cache would map it (no tokenizer)."""
    import numpy as np

    from pipetrain.app.data.token_cache import CacheReport, TokenCorpus

    lengths = [len(d) for d in documents]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.asarray([t for d in documents for t in d], dtype=np.uint32)
    mask = None
    if masks is not None:
        mask = np.asarray([m for ms in masks for m in ms], dtype=np.uint8)
    report = CacheReport(Path("."), True, 0.0, len(documents), int(offsets[-1]), 0, 0)
    return TokenCorpus(
        tokens=tokens,
        offsets=offsets,
        numbers=np.arange(1, len(documents) + 1, dtype=np.int64),
        loss_mask=mask,
        source="memory",
        unit="line",
        pad_token_id=pad,
        max_token_id=int(tokens.max()) if len(tokens) else 0,
        report=report,
    )
