"""Training data from real formats: documents tokenized once into a cache, packed into rows with
their boundaries kept, and batched per step, deterministically from the seed and the step.

The launcher calls ``prepare`` before any process starts (it checks the data, builds the cache,
and returns the corpus with a ``CacheReport`` to print); each worker calls ``prepare`` again
(finding the cache) and iterates ``train_batches``; ``eval_batches`` gives a fixed list. Modules:
``data_options`` (the choices), ``sources`` (records from files), ``documents`` (records
tokenized), ``token_cache`` (the cache), ``packing`` (rows from documents), ``step_batches``
(which documents each step packs), ``token_budget`` (how many micro-batches a step of a token
budget holds), ``prefetch`` (the next step's batch built while this one runs).

Bad data is a one-line ``ValueError`` naming the file, the record and the fix: malformed JSON,
a missing or mistyped field, no documents, chat records for a tokenizer without a chat template,
a document longer than ``seq_len`` under ``long_documents="refuse"``, ``datasets`` missing.
"""

from pipetrain.app.data.data_options import DataOptions
from pipetrain.app.data.step_batches import (
    BatchShape,
    StepBatch,
    eval_batches,
    train_batches,
    transformer_cost,
)
from pipetrain.app.data.token_budget import StepCounts, TokenBudget
from pipetrain.app.data.token_cache import CacheReport, TokenCorpus, default_cache_dir, prepare

__all__ = [
    "BatchShape",
    "CacheReport",
    "DataOptions",
    "StepBatch",
    "StepCounts",
    "TokenBudget",
    "TokenCorpus",
    "default_cache_dir",
    "eval_batches",
    "prepare",
    "train_batches",
    "transformer_cost",
]
