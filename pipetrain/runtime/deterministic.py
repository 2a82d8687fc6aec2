"""Deterministic kernels for a reproducible run (``pipetrain train --deterministic``).

Keyed dropout (``runtime.dropout_rng``) makes every random draw a function of ``--seed``; what
is left between two runs of the same command is kernels whose result depends on timing: atomic
adds in some backward kernels (index_add, scatter, embedding backward) and cuBLAS's split-K
reductions over a workspace shared by streams. ``torch.use_deterministic_algorithms(True)``
picks a deterministic kernel where torch has one (and raises where it has none, naming the op);
cuBLAS is deterministic only with a fixed workspace size per handle, set through
``CUBLAS_WORKSPACE_CONFIG`` before its first handle exists — as torchtitan's deterministic mode
does (``torchtitan/distributed/utils.py``, ``set_determinism``). This flips process-wide
switches on purpose: a worker calls it once, first thing, before anything touches CUDA.
"""

from __future__ import annotations

import os

import torch

#: cuBLAS's variable and the sizes it is deterministic with (NVIDIA's cuBLAS docs, "Results
#: reproducibility"); the first is torchtitan's
CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


def use_deterministic_algorithms() -> None:
    """Deterministic kernels from here on, cuBLAS's included. A ``ValueError`` where CUDA is
    initialised already without a deterministic workspace setting: cuBLAS reads it once."""
    if os.environ.get(CUBLAS_WORKSPACE) not in DETERMINISTIC_WORKSPACES:
        if torch.cuda.is_initialized():
            raise ValueError(
                f"deterministic mode needs {CUBLAS_WORKSPACE}={DETERMINISTIC_WORKSPACES[0]} "
                "before CUDA initialises, and CUDA is initialised already; call "
                "use_deterministic_algorithms() first or set the variable before starting"
            )
        os.environ[CUBLAS_WORKSPACE] = DETERMINISTIC_WORKSPACES[0]
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
