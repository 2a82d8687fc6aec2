"""Two lanes per F&B pair (``runtime.pair_lanes``): with ``overlap_pairs=True`` a DualPipeV pair's
forward runs on a second thread while its backward runs on the caller, expert parallel's
collectives on one group per direction. Exact in float64 on gloo against unsplit training; the
lanes really overlap; a failure in the lane surfaces on every rank."""

from __future__ import annotations

import threading

import pytest
import torch
from pair_lanes_cases import overlapping, run_dense
from runtime_harness import launch
from torch.utils.checkpoint import checkpoint

from pipetrain.runtime.extra_losses import Sink, record_extra_loss
from pipetrain.runtime.pair_lanes import LaneSink


def _check_overlap(spans, pairs) -> list:
    """Every pair's forward ran off the main thread, no other forward did; the pairs whose
    spans intersected."""
    off_main, found = overlapping(spans, pairs)
    assert off_main == {(s, j) for (_, s, j), _ in pairs}, (off_main, pairs)
    return found


@pytest.mark.slow
def test_dense_dualpipev_pairs_on_two_lanes_are_exact_and_a_lane_failure_stops_every_rank():
    """2 ranks, 4 stages: both weight-gradient splits exact to 1e-10, the pairs' forwards on the
    lane; then stage 0 raising in its forward lane on rank 0: rank 0 raises the stage error,
    rank 1 hears of it, neither waits out the timeout. With a dropout that draws (unkeyed, and
    keyed by ``seed``) on stage 2, rank 1 runs every piece on its calling thread. Then expert
    parallel's two directions in flight at once, issued in opposite orders on the two ranks
    (``run_directions``)."""
    results = launch(2, run_dense, timeout=120)
    found = []
    for out in results:
        assert out["failures"] == []
        for defer, spans in out["spans"].items():
            found += _check_overlap(spans, out["pairs"][defer])
    assert found, "no pair's forward and backward ran at the same time"
    first, second = (out["error"] for out in results)
    assert first.startswith("StageError") and "boom in the forward lane" in first, first
    assert "F 0" in first or "0F" in first, first
    assert "rank 0" in second and "boom" in second, second
    assert all(out["seconds"] < 25 for out in results), [out["seconds"] for out in results]
    assert [out["directions"] for out in results] == [[], []]
    for seed in (None, 3):  # rank 1 (stage 2's) on its main thread only, rank 0 on both
        threads = [out[f"dropout seed {seed}: threads"] for out in results]
        assert threads == [[False, True], [True]], (seed, threads)


#: pp 2 × dp 2 with ep 2: DualPipeV's pairs on two lanes under FSDP2 (dense parameters sharded)
#: and, with both decoder layers recomputed per layer (full, selective) and the zero-bubble
#: paper's I/W split, under DDP; the recompute under ZBV without pairs (graph replay's split)
EP_CASES = [
    {"schedule": "dualpipev", "reduction": "mean", "kind": "fsdp", "overlap": True},
    {
        "schedule": "dualpipev",
        "reduction": "token_mean",
        "kind": "ddp",
        "overlap": True,
        "recompute": True,
        "defer": True,
    },
    {
        "schedule": "zbv",
        "reduction": "token_mean",
        "kind": "ddp",
        "overlap": False,
        "recompute": True,
        "defer": False,
    },
]


@pytest.mark.slow
def test_expert_parallel_pairs_on_two_lanes_are_exact() -> None:
    """4 processes: loss, router loss, gradient norm and every gradient against the unsplit
    model to 1e-10 in every case; with ``overlap`` the pairs' forwards ran on the lane, and on
    some rank a forward's span intersected its pair's backward (all-to-alls of both directions
    in flight at once, on their two groups)."""
    pytest.importorskip("transformers")
    from expert_parallel_cases import run_lanes

    cases = [{"recompute": False, "defer": None} | case for case in EP_CASES]
    results = launch(4, run_lanes, cases, timeout=300)
    for label in results[0]:
        outs = [r[label] for r in results]
        assert [o["failures"] for o in outs] == [[]] * 4, label
        if "overlap=True" in label:
            found = [f for o in outs for f in _check_overlap(o["spans"], o["pairs"])]
            assert found, f"{label}: no pair's forward and backward ran at the same time"
        else:
            assert all(sp[3] for o in outs for sp in o["spans"]), label  # one thread


class _Recording(torch.nn.Module):
    """Records an extra loss term in its forward (as a router does)."""

    def forward(self, x):
        record_extra_loss(self, "aux", (x**2).mean())
        return torch.sin(x)  # saves x: its backward unpacks, so the checkpoint recomputes


@pytest.mark.parametrize("sink_kind", [LaneSink, Sink])
def test_a_recompute_inside_the_callers_backward_records_nothing_into_the_lanes_forward(
    sink_kind,
) -> None:
    """The lane's forward collects its terms while the caller's backward recomputes a recording
    layer: the per-thread sink keeps the recompute's record out of the lane's list (a shared
    one would not — the parametrisation shows the test can tell)."""
    sink = sink_kind()
    layer = _Recording()
    sink.install(layer)
    x = torch.ones(3, requires_grad=True)
    with sink.collecting() as own:
        y = checkpoint(layer, x, use_reentrant=False)
    collecting, recomputed = threading.Event(), threading.Event()
    seen: list = []

    def lane() -> None:
        with sink.collecting() as terms:
            collecting.set()
            recomputed.wait(timeout=30)
        seen.append(list(terms))

    thread = threading.Thread(target=lane)
    thread.start()
    collecting.wait(timeout=30)
    y.sum().backward()  # recomputes the layer inside autograd's engine, here
    recomputed.set()
    thread.join(timeout=30)
    assert [n for n, _ in own] == ["aux"]
    assert (seen == [[]]) is (sink_kind is LaneSink), seen
