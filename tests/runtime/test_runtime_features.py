"""Pipeline features on 2 gloo ranks: callable stages, eval_step, timelines, hooks, cleanup."""

from __future__ import annotations

import pytest
from runtime_cases import run_features, run_profiled, run_two_pipelines
from runtime_harness import launch


@pytest.mark.slow
@pytest.mark.parametrize("defer", [False, None], ids=["graph-replay", "default"])
def test_features_on_two_ranks(defer):
    r0, r1 = launch(2, run_features, defer, timeout=90)
    assert r0["local_stages"] == [0, 3] and r1["local_stages"] == [1, 2]  # built only locally
    # by default the linear stages defer their weight GEMMs; the parameter-free one cannot
    expected = (
        {0: True, 3: True, 1: False, 2: True} if defer is None else dict.fromkeys(range(4), False)
    )
    assert {**r0["deferred"], **r1["deferred"]} == expected
    for r in (r0, r1):
        assert r["exact"] == [True, True, True]
        assert r["activations_alive"] == 0 and r["leftovers"] == 0
        assert r["hook_counts"] == [3], "post-accumulate hooks: once per parameter per step"
        assert r["hook_saw_whole_grad"] == [True, True, True]
        is_timeline, measured, ranks, spans, computes = r["timeline"]
        assert is_timeline and measured and ranks == 2 and spans == computes
    assert r0["eval_close"] is True and r1["eval_close"] is None


def test_host_bound_idle_counts_only_gaps_the_host_caused():
    """An idle gap is the host's up to when it began issuing the next action; the rest (and
    every gap before an action issued in time) is waiting for inputs."""
    import torch

    from pipetrain.runtime.timing import Recorder
    from pipetrain.schedule.action import Action, OpKind
    from pipetrain.schedule.timeline import Span

    rec = Recorder(0, torch.device("cpu"), enabled=True)
    assert rec.host_bound_idle([]) is None  # CPU: issuing an action is running it
    rec.cuda = True  # the arithmetic alone, without a device: (start, end, host issue) in ms
    timed = [(0.0, 1.0, 0.0), (3.0, 4.0, 2.0), (5.0, 6.0, 4.5), (6.5, 7.0, 3.0), (8.0, 9.0, 9.5)]
    spans, rec._marks = [], []
    for mb, (start, end, issued) in enumerate(timed):
        action = Action(OpKind.F, 0, mb)
        spans.append(Span(0, action, start, end))
        rec._marks.append((action, None, None, issued / 1e3))
    # gaps: 1→3 host until 2 (1.0); 4→5 host until 4.5 (0.5); 6→6.5 issued early (0);
    # 7→8 issued after it ended (clocks a little apart): the whole gap counts (1.0)
    assert rec.host_bound_idle(spans) == pytest.approx(2.5)


@pytest.mark.slow
def test_two_pipelines_in_one_process_do_not_interfere():
    for r in launch(2, run_two_pipelines, timeout=90):
        assert r["splits"] == ["DeferredLinears", "GraphReplay"]
        assert r["exact"] == [True, True]
        assert r["modules_unchanged"]
        assert "RuntimeError" in r["closed_refuses"] and "closed" in r["closed_refuses"]


def test_profile_label_names_kind_stage_and_microbatch():
    from pipetrain.runtime.executor import profile_label
    from pipetrain.schedule.action import Action, OpKind, overlap

    assert profile_label(Action(OpKind.F, 3, 5)) == "F 3 mb 5"
    assert profile_label(Action(OpKind.SEND_B, 2, 0)) == "SEND_B 2 mb 0"
    pair = overlap(Action(OpKind.F, 1, 4), Action(OpKind.B, 2, 1))
    assert profile_label(pair) == "F 1 mb 4 & B 2 mb 1"


@pytest.mark.slow
def test_a_users_profile_shows_every_action_by_label():
    """Under ``torch.profiler.profile()`` each action of the rank's row is one labelled event:
    computes, overlapped pairs and transfers alike."""
    for rank, r in enumerate(launch(2, run_profiled, ["zbv", "dualpipev"], timeout=90)):
        for name, seen in r.items():
            assert seen["profiled"] == seen["row"], (rank, name)
            kinds = {label.split()[0] for label in seen["row"]}
            assert {"F", "SEND_F", "RECV_F", "SEND_B", "RECV_B"} <= kinds, (rank, name)
        assert any(" & " in label for label in r["dualpipev"]["row"])  # an overlapped pair
        assert f"F {rank} mb 0" in r["zbv"]["row"]
