"""The runtime: the only torch code in pipetrain — runs a program on torch.distributed.

``pipeline.Pipeline`` is the API; ``stage`` wraps one stage (forward, B, I, W); the backward splits
into I and W by ``deferred_wgrad`` (linear layers' weight GEMMs left to W; the default on stages
made mostly of linears) or ``split_backward`` (graph replay, any module); ``p2p`` moves tensors,
``executor`` runs a rank's actions,
``microbatch`` splits and weighs batches and ``timing`` measures a step as a ``Timeline``.
Importing this package does not import torch; its modules do.
"""
