"""The runtime: the only torch code in pipetrain — runs a program on torch.distributed.

``pipeline.Pipeline`` is the API; ``stage`` wraps one stage (forward, B, I, W), ``split_backward``
splits the backward into I and W, ``p2p`` moves tensors, ``executor`` runs a rank's actions,
``microbatch`` splits and weighs batches and ``timing`` measures a step as a ``Timeline``.
Importing this package does not import torch; its modules do.
"""
