"""How a stage's backward splits into ``I`` (input gradients) and ``W`` (weight gradients):
the ``interface`` a stage calls, its two implementations (``deferred_wgrad``, ``graph_replay``)
and what activation checkpointing inside a stage may be (``activation_checkpoint``)."""
