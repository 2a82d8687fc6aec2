"""How a stage's backward splits into ``I`` (input gradients) and ``W`` (weight gradients), and
what activation checkpointing inside a stage may be. Stands on ``comm`` and the stage's module
(``runtime.named_layers``); docs/design.md's "File map" lists its modules."""
