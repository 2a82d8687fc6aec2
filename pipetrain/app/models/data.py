"""A small training corpus the repository makes itself (no downloads), tokenised as bytes.

``make_corpus`` writes deterministic text from a tiny grammar: short English-like sentences and
sums with their answers ("the small cat sees a red ball.", "17 + 25 = 42."). It has enough
structure that a tiny GPT's loss falls clearly within a hundred steps (first the byte
frequencies, then the words, then the arithmetic), and enough variety not to be memorised at once.
Tokens are bytes, so the vocabulary is 256 and no tokenizer is needed.

``batches`` yields ``(inputs, targets)`` windows ``[batch, seq_len]`` of int64 token ids, targets
shifted by one; the same seed gives the same batches on every rank.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

VOCAB_SIZE = 256

_DET = ("the", "a", "one", "every", "that")
_ADJ = ("small", "big", "red", "quiet", "quick", "old", "green", "bright")
_NOUN = ("cat", "dog", "bird", "ball", "tree", "house", "river", "robot", "child", "star")
_VERB = ("sees", "likes", "follows", "finds", "paints", "hears", "carries", "watches")
_PLACE = ("in the garden", "by the river", "at night", "on the hill", "near the house")


def _sentence(rng: random.Random) -> str:
    def noun_phrase() -> str:
        adj = f"{rng.choice(_ADJ)} " if rng.random() < 0.6 else ""
        return f"{rng.choice(_DET)} {adj}{rng.choice(_NOUN)}"

    text = f"{noun_phrase()} {rng.choice(_VERB)} {noun_phrase()}"
    if rng.random() < 0.4:
        text += f" {rng.choice(_PLACE)}"
    return text + "."


def _sum(rng: random.Random) -> str:
    a, b = rng.randrange(100), rng.randrange(100)
    return f"{a} + {b} = {a + b}."


def make_corpus(num_bytes: int = 1 << 18, seed: int = 1234) -> bytes:
    """About ``num_bytes`` of generated text, one sentence or sum per line."""
    if num_bytes < 1:
        raise ValueError(f"num_bytes must be >= 1, got {num_bytes}")
    rng = random.Random(seed)
    lines: list[str] = []
    size = 0
    while size < num_bytes:
        line = _sentence(rng) if rng.random() < 0.7 else _sum(rng)
        lines.append(line)
        size += len(line) + 1
    return ("\n".join(lines) + "\n").encode("ascii")[:num_bytes]


def corpus_tensor(num_bytes: int = 1 << 18, seed: int = 1234) -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values."""
    return torch.frombuffer(bytearray(make_corpus(num_bytes, seed)), dtype=torch.uint8).long()


def batches(
    tokens: torch.Tensor, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random windows: ``inputs = tokens[i : i + seq_len]``, ``targets`` one further."""
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if tokens.numel() <= seq_len + 1:
        raise ValueError(f"corpus of {tokens.numel()} tokens is too short for seq_len {seq_len}")
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size, 1), generator=gen)
        window = tokens[starts + offsets]
        yield window[:, :-1], window[:, 1:]
