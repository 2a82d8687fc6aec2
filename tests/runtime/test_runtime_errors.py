"""Bad input: clear errors before any transfer, and timeouts naming rank, action and peer."""

from __future__ import annotations

import pytest
import torch
from runtime_cases import build_stages, loss_fn, run_errors
from runtime_harness import launch

import pipetrain
from pipetrain.runtime.microbatch import split


def test_no_process_group_is_refused_clearly():
    with pytest.raises(RuntimeError, match="init_process_group"):
        pipetrain.Pipeline(build_stages(2), "1f1b", 2, loss_fn)


def test_uneven_split_weights_sum_to_one_and_too_many_microbatches_are_refused():
    mbs = split(torch.zeros(10, 3), torch.zeros(10), 4)
    assert [x[0].shape[0] for x in mbs.inputs] == [3, 3, 2, 2]
    assert sum(mbs.weights) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="legal values are 1..3"):
        split(torch.zeros(3, 2), None, 4)


@pytest.mark.slow
def test_bad_input_on_two_ranks():
    r0, r1 = launch(2, run_errors, timeout=90)
    for r in (r0, r1):  # a refusal: the same type on every rank
        assert "PipelineRefused" in r["stage_count"] and "3 stages" in r["stage_count"]
        assert "PipelineRefused" in r["world"] and "process group has 2" in r["world"]
        assert "ValueError" in r["too_many_mb"] and "batch size 3" in r["too_many_mb"]
        assert "PipelineRefused" in r["two_copies"] and "use dualpipev" in r["two_copies"]
        assert "PipelineRefused" in r["receive_lead"] and ">= 0, got -1" in r["receive_lead"]
    # The last stage's rank sees the bad loss; the other stops on its wait, naming the failing
    # rank and its error (these pipelines run on a group of the caller's: the notice is read
    # when the wait ends, after the 2 s timeout).
    assert "loss_fn must return a scalar" in r1["non_scalar"] and "stage 1" in r1["non_scalar"]
    assert "PeerFailedError" in r0["non_scalar"] and "rank 0" in r0["non_scalar"]
    assert "RECV_B" in r0["non_scalar"] and "rank 1 failed" in r0["non_scalar"]
    assert "loss_fn must return a scalar" in r0["non_scalar"]
    assert "stage 1 would receive 2 tensor(s)" in r0["arity"]
    assert "PeerFailedError" in r1["arity"] and "RECV_F" in r1["arity"]
    assert "rank 0 failed" in r1["arity"] and "would receive 2 tensor(s)" in r1["arity"]
