"""The runtime: the only torch code in pipetrain — runs a program on torch.distributed.

``pipeline.Pipeline`` is the API; ``resolve`` decides everything a pipeline runs before it runs;
``stage`` wraps one stage (forward, B, I, W); ``executor`` runs a rank's actions;
``microbatch`` splits and weighs batches; ``timing`` measures a step as a ``Timeline``;
``torch_compat`` holds every private torch interface the runtime uses.

Sub-packages, one idea each:

* ``backward``: how a stage's backward splits into I and W — the ``interface`` (one
  ``BackwardSplit`` per stage), ``deferred_wgrad`` (linear layers' weight GEMMs left to W),
  ``graph_replay`` (any module, by replaying graph nodes) and ``activation_checkpoint`` (which
  ``torch.utils.checkpoint`` variants split exactly);
* ``comm``: moving tensors between ranks (``p2p``), agreeing on values (``agreement``) and
  surfacing a failure on every rank (``failures``);
* ``parallel``: the other dimensions of a job — ``data_parallel`` (DDP/FSDP2 on a mesh),
  ``tied`` (tied weights' gradients summed across stages), ``grad_norm`` (clipping by the
  global norm).

For training jobs (docs/training.md): ``layers`` cuts a layer list into stages (``split``),
``losses`` weighs micro-batches by the loss's reduction, ``checkpoint`` saves and loads by global
name, ``side_inputs`` hands masks and the like to stages, ``profile_layers`` measures layers for
the planner. Importing this package does not import torch; its modules do.
"""
