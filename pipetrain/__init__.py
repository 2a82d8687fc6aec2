"""pipetrain: pipeline-parallel training for PyTorch, from plan to run.

Schedules are data (``pipetrain.schedule``), checked and simulated before they run
(``pipetrain.sim``), drawn (``pipetrain.render``) and run on torch.distributed
(``pipetrain.runtime``). Importing this package does not import torch: ``Pipeline`` is loaded on
first use.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The library logs decisions a user may want to see (INFO) and per-step detail (DEBUG) to the
# ``pipetrain`` logger's children; whether and where they show is the application's choice
# (docs/runtime.md, "Logging and profiling"), so the library adds no handler that prints.
logging.getLogger(__name__).addHandler(logging.NullHandler())

if TYPE_CHECKING:
    from pipetrain.planner import plan
    from pipetrain.runtime.checkpoint import load_checkpoint, save_checkpoint
    from pipetrain.runtime.comm.failures import PeerFailedError, PipelineRefused, StageError
    from pipetrain.runtime.comm.p2p import PipelineTimeoutError
    from pipetrain.runtime.layers import split
    from pipetrain.runtime.losses import TokenCrossEntropy
    from pipetrain.runtime.pipeline import Pipeline
    from pipetrain.runtime.profile.profile_layers import profile

__all__ = [
    "PeerFailedError",
    "Pipeline",
    "PipelineRefused",
    "PipelineTimeoutError",
    "StageError",
    "TokenCrossEntropy",
    "__version__",
    "load_checkpoint",
    "plan",
    "profile",
    "save_checkpoint",
    "split",
]

# Loaded on first use: name -> module that defines it (all but ``plan`` import torch).
_LAZY = {
    "Pipeline": "pipetrain.runtime.pipeline",
    "PipelineRefused": "pipetrain.runtime.comm.failures",
    "PeerFailedError": "pipetrain.runtime.comm.failures",
    "StageError": "pipetrain.runtime.comm.failures",
    "PipelineTimeoutError": "pipetrain.runtime.comm.p2p",
    "plan": "pipetrain.planner",
    "profile": "pipetrain.runtime.profile.profile_layers",
    "split": "pipetrain.runtime.layers",
    "TokenCrossEntropy": "pipetrain.runtime.losses",
    "save_checkpoint": "pipetrain.runtime.checkpoint",
    "load_checkpoint": "pipetrain.runtime.checkpoint",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pipetrain' has no attribute {name!r}")
