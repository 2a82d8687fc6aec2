"""The runtime: the only torch code in pipetrain besides ``hf`` — runs a program on
torch.distributed. ``pipeline.Pipeline`` is the API.

What each module and sub-package owns is docs/design.md's "File map" (one list, checked against
the tree); which sub-package may import which is its "Import rules" (``comm`` at the bottom,
then ``backward``, ``parallel``, and the profiler, ``profile``, at the top), held by
tests/test_rules.py. Importing this package does not import torch; its modules do.
"""
