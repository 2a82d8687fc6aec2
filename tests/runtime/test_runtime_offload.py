"""Activation offload in the runtime: the program's OFFLOAD/RELOAD actions move saved tensors to
host memory and back (plain copies on CPU), layer by layer where a stage is a list of layers, and
training stays exact in float64 against unsplit training under 1F1B, interleaved 1F1B, ZB-H1, ZBV
and DualPipeV with either weight-gradient split (2 ranks, gloo), each stage moving exactly its
first ⌈f·L⌉ layers' saved bytes per offloaded micro-batch; bad fractions are refused at
construction."""

from __future__ import annotations

import pytest
from offload_cases import run_offload, run_offload_with_recompute
from runtime_harness import launch


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, True], ids=["graph-replay", "deferred-wgrad"])
def test_offloaded_training_is_exact_and_moves_the_bytes(defer):
    results = launch(2, run_offload, defer, timeout=300)
    for r in results:
        assert not r["differences"], "\n".join(r["differences"])
    moved = {k: v for r in results for k, v in r["moved"].items()}
    assert moved, "no stage offloaded"
    layered = 0
    for key, (moved_bytes, saved_bytes, fraction, expected) in moved.items():
        assert saved_bytes > 0 and moved_bytes > 0, key
        if expected is not None:  # layer by layer: the first ⌈f·L⌉ layers, every one of them
            assert moved_bytes == expected, key
            layered += 1
            continue
        # in one piece: whole tensors, first saved first, until at least the fraction has moved
        assert fraction * saved_bytes <= moved_bytes <= saved_bytes, key
        if fraction == 1.0:
            assert moved_bytes == saved_bytes, key
    assert layered and layered < len(moved)
    refusals = results[0]["refusals"]
    assert "offload fraction of stage 0 must be a number in [0, 1]" in refusals["range"]
    assert "give one per stage (2)" in refusals["length"]
    assert "nothing to offload there" in refusals["nothing"]
    assert "the program has OFFLOAD/RELOAD actions; pass offload=" in refusals["copies"]
    assert int(refusals["own copies moved"]) > 0
    # a plan's offload through Pipeline.from_plan: stage 0 (rank 0) moves bytes, rank 1 none,
    # each reload issued where the plan's reload_lead (0: right before its backward) says
    (moved0, copies0, before0), (moved1, copies1, _) = (r["from_plan"] for r in results)
    assert moved0 and copies0 > 0 and moved1 is None and copies1 == 0 and before0


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, True], ids=["graph-replay", "deferred-wgrad"])
def test_offload_composes_with_a_plans_recompute(defer):
    """A zbv plan's stages recomputing (full) and offloading at once, through
    ``Pipeline.from_plan``: what a checkpoint saves stays the checkpoint's, the rest is offloaded,
    and the loss and every gradient equal the plan's without either; selective recompute with
    offload on one stage is refused from the plan."""
    results = launch(2, run_offload_with_recompute, defer, timeout=300)
    for r in results:
        assert r["difference"] < 1e-12, r["difference"]
        assert r["same_names"]
    moved = {s: b for r in results for s, b in r["moved"].items()}
    assert set(moved) == {0, 1, 2} and moved[1] > 0 and moved[2] > 0, moved
    for r in results:
        assert "recompute 'selective' and offload: not run together" in r["refused"]
