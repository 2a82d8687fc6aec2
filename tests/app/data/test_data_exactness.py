"""The packing contract, proven on ``transformers``' unsplit model: packed rows run with their
``position_ids`` (no attention mask) give every document the logits and the loss it gets run
alone, in float64 (``use_cache=False``: with a cache ``transformers`` does not look for packed
documents; the pipeline's layers pass none). What the pipeline does with the same rows is the lead's float64 tests."""

from __future__ import annotations

import itertools

import pytest
import torch
from data_cases import VOCAB, chat, write_jsonl, write_tokenizer

from pipetrain.app.data import BatchShape, DataOptions, prepare, train_batches
from pipetrain.hf.masks import IGNORE_INDEX

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SEQ = 48


def tiny_llama(implementation: str):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        attn_implementation=implementation,
    )
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(config).double().eval()


#: the tolerance per attention implementation: float64 rounding for SDPA; Llama's eager attention
#: takes its softmax in float32 whatever the model's dtype, so it agrees to float32 rounding (a
#: token attending across documents would differ by orders of magnitude more)
TOLERANCE = {"sdpa": 1e-12, "eager": 1e-6}


@pytest.mark.parametrize("implementation", sorted(TOLERANCE))
def test_packed_rows_equal_each_document_run_alone(tmp_path, implementation):
    records = [
        {"text": "the cat sat."},
        chat("sum 2 and 3", "5"),
        {"text": "a much longer line of text, to share a row."},
        chat("hi", "hello!", "bye", "see you"),
        {"text": "ok"},
    ]
    data = write_jsonl(tmp_path / "d.jsonl", records)
    corpus = prepare(data, write_tokenizer(tmp_path / "tok"), DataOptions(seq_len=SEQ), tmp_path)
    shape = BatchShape(dp=1, microbatches=2, microbatch_size=2)
    batches = train_batches(corpus, DataOptions(seq_len=SEQ), shape, seed=0)
    model = tiny_llama(implementation)
    tol = TOLERANCE[implementation]
    for batch in itertools.islice(batches, 2):
        assert any(len(row) > 1 for row in batch.rows)  # documents do share rows
        with torch.no_grad():
            logits = model(
                input_ids=batch.inputs, position_ids=batch.side["position_ids"], use_cache=False
            ).logits
        packed_loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch.targets.flatten(), reduction="sum"
        )
        alone_loss = torch.zeros((), dtype=torch.float64)
        for r, row in enumerate(batch.rows):
            at = 0
            for index in row:
                ids, mask = corpus.document(index)
                ids = torch.from_numpy(ids.astype("int64"))[None]
                with torch.no_grad():
                    alone = model(input_ids=ids, use_cache=False).logits[0]
                n = ids.shape[1]
                torch.testing.assert_close(logits[r, at : at + n], alone, rtol=tol, atol=tol)
                labels = ids[0].clone()
                if mask is not None:
                    labels[torch.from_numpy(mask == 0)] = IGNORE_INDEX
                alone_loss += torch.nn.functional.cross_entropy(
                    alone[:-1], labels[1:], reduction="sum"
                )
                at += n
        torch.testing.assert_close(packed_loss, alone_loss, rtol=tol, atol=tol)
        assert batch.predicted_tokens > 0
