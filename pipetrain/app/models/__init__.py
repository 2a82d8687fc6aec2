"""Models to train with pipetrain: a small GPT cut into pipeline stages, and its dataset.

This package imports torch (it is application code, like ``pipetrain.app.train``); the planning
packages never import it.
"""

from pipetrain.app.models.data import VOCAB_SIZE, batches, corpus_tensor, make_corpus
from pipetrain.app.models.gpt import (
    GPTConfig,
    GPTStage,
    build_gpt,
    gpt_layers,
    gpt_stage,
    lm_loss,
    make_stage,
    split_gpt,
    stage_layers,
)

__all__ = [
    "VOCAB_SIZE",
    "GPTConfig",
    "GPTStage",
    "batches",
    "build_gpt",
    "corpus_tensor",
    "gpt_layers",
    "gpt_stage",
    "lm_loss",
    "make_corpus",
    "make_stage",
    "split_gpt",
    "stage_layers",
]
