"""Extra loss terms from a stage's layers (``runtime.extra_losses``): exact in float64 on gloo
against the unsplit model under gradient accumulation — loss, the reported terms and every
gradient — under 1F1B, interleaved 1F1B, ZBV with either weight-gradient split, DualPipeV, with
per-layer and whole-stage recompute, and under data parallel (averaged and summed replicas);
and the recording contract outside a pipeline, in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from extra_loss_cases import CASES, DP_CASES, run_data_parallel, run_schedules
from runtime_harness import launch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipetrain.runtime.comm.failures import PipelineRefused
from pipetrain.runtime.extra_losses import (
    Sink,
    record_extra_loss,
    take_extra_losses,
    term_weight,
)
from pipetrain.runtime.stage import StageRunner


@pytest.fixture(scope="module")
def two_ranks():
    return launch(2, run_schedules, timeout=300)


@pytest.mark.slow
def test_every_schedule_and_recompute_matches_gradient_accumulation(two_ranks):
    problems = [f for r in two_ranks for f in r["failures"]]
    assert not problems, "\n".join(problems)
    for label, *_ in CASES:  # every rank reports every name, stage 0's and the last's alike
        assert two_ranks[0]["reports"][label] == two_ranks[1]["reports"][label]
        assert sorted(two_ranks[0]["reports"][label]) == ["aux", "late", "z"]


@pytest.mark.slow
def test_data_parallel_averages_terms_over_every_replica_and_refuses_differing_names():
    results = launch(4, run_data_parallel, timeout=300)
    problems = [f for r in results for f in r["failures"]]
    assert not problems, "\n".join(problems)
    for label, *_ in DP_CASES:
        assert all(r["reports"][label] == results[0]["reports"][label] for r in results)
    for r in results:  # replicas that record different names: refused on every rank alike
        assert "replicas recorded different extra loss names" in r["refusal"], r["refusal"]


class Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3).double()

    def forward(self, h):
        out = self.a(h)
        record_extra_loss(self, "aux", out.pow(2).mean())
        return out


def test_a_plain_forward_keeps_its_terms_until_taken_or_the_next_forward():
    model = nn.Sequential(Recorder(), Recorder())
    x = torch.randn(2, 3, dtype=torch.float64)
    model(x)
    model(x)  # the first forward's terms are let go, not added
    terms = take_extra_losses(model)
    expected = model[0](x).pow(2).mean() + model[1](model[0](x)).pow(2).mean()
    take_extra_losses(model)
    assert list(terms) == ["aux"] and terms["aux"].requires_grad
    torch.testing.assert_close(terms["aux"], expected, rtol=0, atol=0)
    assert take_extra_losses(model) == {}  # taken: cleared
    model(x)
    clone = copy.deepcopy(model)  # a term with a graph cannot be copied: the copy has none
    assert take_extra_losses(clone) == {} and list(take_extra_losses(model)) == ["aux"]


def test_records_are_refused_unless_scalar_floating_and_named():
    layer = Recorder()
    for name, value, what in [
        ("aux", torch.ones(2), "scalar tensor"),
        ("aux", 1.0, "scalar tensor"),
        ("", torch.ones(()), "non-empty string"),
        ("aux", torch.ones((), dtype=torch.long), "floating point"),
    ]:
        with pytest.raises(ValueError, match=what):
            record_extra_loss(layer, name, value)


def test_a_stage_sink_collects_during_its_forward_and_nothing_else_changes():
    model = Recorder()
    sink = Sink()
    sink.install(model)
    x = torch.randn(2, 3, dtype=torch.float64)
    with sink.collecting() as terms:
        model(x)
    assert [n for n, _ in terms] == ["aux"] and take_extra_losses(model) == {}
    model(x)  # outside the stage's forward (eval_step, a closed pipeline): kept as plain
    assert list(take_extra_losses(model)) == ["aux"]
    assert copy.deepcopy(model).__dict__.get("_pipetrain_extra_loss_sink") is None
    sink.uninstall(model)
    assert "_pipetrain_extra_loss_sink" not in model.__dict__


def test_a_checkpoint_recompute_records_nothing():
    model = Recorder()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    out = checkpoint(model, x, use_reentrant=False)
    terms = take_extra_losses(model)
    (out.sum() + terms["aux"]).backward()  # recomputes the forward, inside the backward
    assert take_extra_losses(model) == {}  # dropped: the forward's term held the graph
    out = checkpoint(model, x, use_reentrant=False)
    out.sum().backward()  # taken after the backward: the recompute neither adds nor clears
    torch.testing.assert_close(take_extra_losses(model)["aux"], terms["aux"], rtol=0, atol=0)


def test_term_weight_follows_how_replicas_combine_gradients():
    class Replicas:
        def __init__(self, reduction: str) -> None:
            self.reduction, self.size = reduction, 2

    assert term_weight(4, None) == 0.25
    assert term_weight(4, Replicas("mean")) == 0.25  # the replicas' average halves it
    assert term_weight(4, Replicas("sum")) == 0.125


def test_a_captured_step_refuses_extra_losses():
    runner = StageRunner(0, Recorder(), True, lambda out, y: out.sum(), captured=True)
    x = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(PipelineRefused, match="cuda_graph=False"):
        runner.forward(0, (x,), None, 1.0)
