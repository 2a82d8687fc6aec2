"""A refusal has the same exception type on every rank and the type the docs name: pipetrain's
``PipelineRefused``, a ``ValueError`` — where it was found with its own message, on the peers
naming that rank and its message (docs/runtime.md, "When something fails")."""

from __future__ import annotations

import pytest
from refusal_cases import run_refusals
from runtime_harness import launch

from pipetrain.runtime.comm.failures import PipelineRefused


@pytest.mark.slow
def test_a_refusal_is_pipeline_refused_on_every_rank():
    results = launch(2, run_refusals, timeout=120)
    # the reentrant checkpoint is found by rank 0 at its first forward
    for rank, result in enumerate(results):
        name, is_value_error, message = result["reentrant"]
        assert (name, is_value_error) == ("PipelineRefused", True), (rank, result)
        assert "use_reentrant=False" in message, message
        if rank == 1:
            assert "rank 0 failed" in message, message
    # a bad argument that only the last rank was given, found while building the pipeline
    for rank, result in enumerate(results):
        name, is_value_error, message = result["construction"]
        assert (name, is_value_error) == ("PipelineRefused", True), (rank, result)
        assert "receive's lead" in message, message
        if rank == 0:
            assert "rank 1 failed: building its Pipeline" in message, message
    # a CUDA graph on a CPU pipeline: every rank finds it at construction, itself
    for result in results:
        name, is_value_error, message = result["cuda_graph"]
        assert (name, is_value_error) == ("PipelineRefused", True), result
        assert "cuda_graph=True captures the step on a CUDA device" in message, message
    assert issubclass(PipelineRefused, ValueError)
