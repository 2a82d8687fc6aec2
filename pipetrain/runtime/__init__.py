"""The runtime: the only torch code in pipetrain — runs a program on torch.distributed.

``pipeline.Pipeline`` is the API; ``stage`` wraps one stage (forward, B, I, W); the backward splits
into I and W through one ``backward_split.BackwardSplit`` per stage: ``deferred_wgrad`` (linear
layers' weight GEMMs left to W; the default on stages made mostly of linears) or
``split_backward`` (graph replay, any module); ``torch_compat`` holds every private torch
interface the runtime uses; ``p2p`` moves tensors,
``executor`` runs a rank's actions,
``microbatch`` splits and weighs batches and ``timing`` measures a step as a ``Timeline``.
For training jobs (docs/training.md): ``layers`` cuts a layer list into stages (``split``),
``losses`` weighs micro-batches by the loss's reduction, ``tied`` sums tied weights' gradients,
``grad_norm`` clips by the global norm, ``checkpoint`` saves and loads by global name,
``side_inputs`` hands masks and the like to stages, ``activation_checkpoint`` polices
``torch.utils.checkpoint``.
Importing this package does not import torch; its modules do.
"""
