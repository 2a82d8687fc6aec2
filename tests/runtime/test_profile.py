"""The profiler on CPU: a costs file that round-trips, positive times, hand-counted bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pipetrain.planner import load_costs, plan
from pipetrain.runtime.profile.profile_layers import CPU_BANDWIDTH, CPU_LATENCY_MS, GIB, profile


def test_profile_counts_activation_and_static_bytes_by_hand(tmp_path) -> None:
    torch.manual_seed(0)
    b, d, h = 8, 16, 32
    linear = nn.Linear(d, h).double()
    mlp = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, d)).double()
    path = tmp_path / "costs.json"
    x = torch.randn(b, d, dtype=torch.float64)
    costs = profile(
        [linear, mlp], x, repeats=2, warmup=1, names=["linear", "mlp"], path=path,
        loss_fn=lambda y, t: ((y - t) ** 2).mean(), target=torch.zeros(b, d, dtype=torch.float64),
    )  # fmt: skip
    assert load_costs(path) == costs
    first, second = costs.layers
    assert [first.name, second.name] == ["linear", "mlp"]
    # Linear saves its input; the MLP its input, the GELU's input and the second Linear's input;
    # the loss (last layer) saves y - t
    assert first.activation * GIB == 8 * b * d
    assert second.activation * GIB == 8 * b * (h + 2 * h + 2 * h + d)
    # checkpointed (a plan's full recompute): the input alone; on the last layer also what the
    # loss saves, which runs outside the checkpointed region
    assert first.recompute_activation * GIB == 8 * b * d
    assert second.recompute_activation * GIB == 8 * b * (h + d)
    # selective: also the outputs of matrix products (the Linear's addmm; the MLP's two)
    assert first.selective_activation * GIB == 8 * b * (d + h)
    assert second.selective_activation * GIB == 8 * b * (h + 2 * h + d + d)
    # what checkpointing adds to each backward, timed (tested with a stubbed clock below)
    assert all(x.recompute >= 0 and x.selective_recompute >= 0 for x in costs.layers)
    (window,) = costs.meta["context"]["recompute"]  # both layers: one window
    assert (window["first"], window["end"]) == (0, 2) and window["selective_recompute"] > 0
    assert costs.host_bandwidth_gbs is None  # measured on CUDA only
    # AdamW: parameter + gradient + two states, float64
    params = sum(p.numel() for p in linear.parameters())
    assert first.params * GIB == 8 * params * 4
    # AdamW's update makes a denominator the size of the parameters while it runs
    assert first.optimizer_workspace * GIB == 8 * params
    for layer in costs.layers:
        assert layer.forward > 0 and layer.backward > 0
        assert layer.backward_input > 0 and layer.backward_weight > 0
    assert first.comm == pytest.approx(CPU_LATENCY_MS + 8 * b * h / CPU_BANDWIDTH * 1e3)
    assert second.comm == 0.0  # the loss is the last layer's output: nothing is sent
    assert costs.meta["optimizer"] == "adamw" and "model" in costs.meta["comm_method"]


def test_profile_chains_tuples_and_feeds_the_planner() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x, y=None):
            y = x if y is None else y
            return self.a(x), self.b(y)

    class Sum(nn.Module):
        def forward(self, x, y):
            return x + y

    costs = profile(
        [Pair(), Pair(), Sum()], torch.randn(3, 4), repeats=1, warmup=0, optimizer="sgd"
    )
    assert costs.num_layers == 3 and costs.split_backward
    assert costs.layers[2].params == 0.0
    pick = plan(costs, num_ranks=2, memory_gib=1.0, schedules=["1f1b"])
    assert sum(pick.stage_layers) == 3


def test_profile_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown optimizer"):
        profile([nn.Linear(2, 2)], torch.randn(1, 2), optimizer="lion")
    with pytest.raises(ValueError, match="at least one layer"):
        profile([], torch.randn(1, 2))


def test_gpt_stages_cut_by_a_plan_hold_the_unsplit_weights() -> None:
    from pipetrain.app.models.gpt import GPTConfig, build_gpt, gpt_stage

    cfg = GPTConfig(vocab_size=16, seq_len=8, num_layers=4, hidden=8, num_heads=2)
    whole = build_gpt(cfg).state_dict()
    for cut in ((1, 4, 1), (3, 3), (2, 1, 2, 1), (6,)):
        parts = [gpt_stage(cfg, cut, s).state_dict() for s in range(len(cut))]
        union = {k: v for part in parts for k, v in part.items()}
        assert sum(len(p) for p in parts) == len(union) == len(whole)
        assert all(torch.equal(union[k], v) for k, v in whole.items())
    with pytest.raises(ValueError, match="summing to 6"):
        gpt_stage(cfg, (2, 2), 0)


def test_cli_profile_writes_a_costs_file_the_planner_reads(tmp_path, capsys) -> None:
    from pipetrain.cli import main

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny layers on a shared box: thread hand-offs dominate
    try:
        _cli_profile(tmp_path, capsys, main)
    finally:
        torch.set_num_threads(threads)


def _cli_profile(tmp_path, capsys, main) -> None:
    out = tmp_path / "gpt.json"
    args = ["--model", "gpt", "--layers", "2", "--hidden", "8", "--heads", "2", "--vocab", "32"]
    args += ["--seq-len", "8"]
    assert main(["profile", "--out", str(out), *args, "--repeats", "1", "--device", "cpu"]) == 0
    costs = load_costs(out)
    assert [layer.name for layer in costs.layers] == ["embed", "block0", "block1", "head"]
    assert costs.meta["model"] == "gpt" and costs.meta["timing"] == "wall"
    assert main(["profile", *args, "--timing", "device", "--device", "cpu"]) == 2
    assert "--timing device reads a GPU's busy time" in capsys.readouterr().err
    assert main(["plan", "--costs", str(out), "--ranks", "2", "--memory-gib", "1", "--json"]) == 0
    assert "note:" not in capsys.readouterr().err  # wall-timed costs for an eager run
    graphed = ["plan", "--costs", str(out), "--ranks", "2", "--memory-gib", "1", "--cuda-graph"]
    assert main([*graphed, "--json"]) == 0
    assert "note: --cuda-graph with costs timed on the wall clock" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_status:  # argparse: usage error, exit 2
        main(["profile", "--out", str(out), "--layers", "0"])
    assert exit_status.value.code == 2
    assert "--layers: expected an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["profile", "--model", "gpt", "--tie-embeddings"]) == 2
    assert "--tie-embeddings applies to the Hugging Face models" in capsys.readouterr().err


def test_profile_scales_lone_times_by_their_window_timed_as_one_stage(monkeypatch) -> None:
    """Each window of ``context`` layers is run as one stage; its layers' lone times are scaled
    so that they sum to the window's time (a lone layer leaves the GPU idle at its edges that a
    stage does not); a one-layer tail window is left as it was; the loss runs in the last window."""
    import pipetrain.runtime.profile.profile_layers as profiler

    real = profiler._measure
    seen = []

    def fixed(runner, *args, **kwargs):
        cost, outputs = real(runner, *args, **kwargs)
        chain = getattr(runner.module, "layer_names", None)
        seen.append((chain, runner.is_last))
        # a lone layer "takes" 2 ms of each time, a window 3 ms per layer in it
        per_layer = 3.0 if chain else 2.0
        width = len(chain) if chain else 1
        cost.update({k: per_layer * width for k in profiler.TIMES})
        if chain and chain[0] == "layer0":  # a window at the model's input: W does what I did
            cost.update(backward_input=0.0, backward_weight=2 * per_layer * width)
        return cost, outputs

    monkeypatch.setattr(profiler, "_measure", fixed)
    layers = [nn.Linear(4, 4) for _ in range(5)]
    costs = profile(
        layers, torch.randn(3, 4), repeats=1, warmup=0, context=2,
        loss_fn=lambda y, t: (y**2).mean(), target=None,
    )  # fmt: skip
    windows = costs.meta["context"]["windows"]
    assert [(w["first"], w["end"]) for w in windows] == [(0, 2), (2, 4)]
    assert all(w["forward"] == pytest.approx(1.5) for w in windows)
    assert all(w["split_backward"] == pytest.approx(1.5) for w in windows)
    assert [layer.forward for layer in costs.layers] == pytest.approx([3, 3, 3, 3, 2])
    # I and W keep the lone split, scaled by the window's I + W: the first window's empty I
    # does not empty its layers' I (a stage starting at layer 1 needs it)
    assert [layer.backward_input for layer in costs.layers] == pytest.approx([3, 3, 3, 3, 2])
    assert [layer.backward_weight for layer in costs.layers] == pytest.approx([3, 3, 3, 3, 2])
    assert seen[5:7] == [(("layer0", "layer1"), False), (("layer2", "layer3"), False)]
    before = len(seen)
    whole = profile(layers, torch.randn(3, 4), repeats=1, warmup=0, context=5,
                    loss_fn=lambda y, t: (y**2).mean(), target=None)  # fmt: skip
    # the loss in its window
    assert seen[before + 5] == (tuple(f"layer{i}" for i in range(5)), True)
    assert whole.meta["context"]["windows"][0]["end"] == 5
    with pytest.raises(ValueError, match="context"):
        profile(layers, torch.randn(3, 4), context=0)


def test_recompute_is_timed_as_what_checkpointing_adds_to_the_backward(monkeypatch) -> None:
    """``recompute`` and ``selective_recompute``: a layer's backward checkpointed less its plain
    backward, timed alone, then scaled by windows timed plain and checkpointed as one stage; a
    difference below zero counts as 0 (a stubbed clock). ``recompute_forward`` and
    ``selective_forward``: the same for the forward."""
    import pipetrain.runtime.profile.profile_layers as profiler
    from pipetrain.planner.recompute import recomputed_layer
    from pipetrain.planner.recompute_modes import Recompute
    from pipetrain.runtime.backward.activation_checkpoint import Recomputed

    real = profiler._measure
    # ms a checkpointed layer adds to the backward: alone, in a window (the last layer: less)
    added = {"full": (1.0, 0.6), "selective": (0.25, 0.2)}
    # ms a checkpointed layer adds to the forward (its bookkeeping): alone, in a window
    added_forward = {"full": (0.5, 0.1), "selective": (2.0, 1.0)}

    def fixed(runner, *args, **kwargs):
        cost, outputs = real(runner, *args, **kwargs)
        chain = getattr(runner.module, "chain", None)
        if chain is None or kwargs.get("split", True):  # the other times: not under test
            return cost, outputs
        alone = len(chain) == 1
        backward = len(chain) * (2.0 if alone else 1.5)
        forward = len(chain) * (1.0 if alone else 0.8)
        for layer, _ in chain:
            if isinstance(layer, Recomputed):
                last = runner.is_last and alone
                backward += -0.1 if last else added[layer.mode][0 if alone else 1]
                forward += added_forward[layer.mode][0 if alone else 1]
        cost["backward"], cost["forward"] = backward, forward
        return cost, outputs

    monkeypatch.setattr(profiler, "_measure", fixed)
    layers = [nn.Linear(4, 4) for _ in range(5)]
    costs = profile(
        layers, torch.randn(3, 4), repeats=1, warmup=0, context=2,
        loss_fn=lambda y, t: (y**2).mean(), target=None,
    )  # fmt: skip
    # windows (0, 2) and (2, 4): full 1.2 ms for 2 ms alone, selective 0.4 for 0.5; the tail
    # layer (the loss outside its region) keeps its lone difference, clipped at 0
    assert [x.recompute for x in costs.layers] == pytest.approx([0.6, 0.6, 0.6, 0.6, 0.0])
    assert [x.selective_recompute for x in costs.layers] == pytest.approx([0.2] * 4 + [0.0])
    ratios = costs.meta["context"]["recompute"]
    assert [(w["first"], w["end"]) for w in ratios] == [(0, 2), (2, 4)]
    assert all(w["recompute"] == pytest.approx(0.6) for w in ratios)
    assert all(w["selective_recompute"] == pytest.approx(0.8) for w in ratios)
    # forwards: windows (0, 2) and (2, 4) add 0.2 of 1.0 alone (full) and 2.0 of 4.0
    # (selective); the tail layer keeps its lone difference
    assert [x.recompute_forward for x in costs.layers] == pytest.approx([0.1] * 4 + [0.5])
    assert [x.selective_forward for x in costs.layers] == pytest.approx([1.0] * 4 + [2.0])
    assert all(w["recompute_forward"] == pytest.approx(0.2) for w in ratios)
    assert all(w["selective_forward"] == pytest.approx(0.5) for w in ratios)
    # the planner pays what was measured, in the backward and in the forward
    layer = costs.layers[0]
    for mode, paid, more in ((Recompute.FULL, 0.6, 0.1), (Recompute.SELECTIVE, 0.2, 1.0)):
        assert recomputed_layer(layer, mode).backward == pytest.approx(layer.backward + paid)
        assert recomputed_layer(layer, mode).forward == pytest.approx(layer.forward + more)
    assert recomputed_layer(layer, Recompute.NONE).forward == layer.forward


def test_profile_times_the_backward_a_pipeline_runs_for_most_micro_batches(monkeypatch) -> None:
    """Without a hook that needs a step's whole gradient, every backward piece of a stage runs
    alike, the last included: under deferral a ``B`` adds its weight gradients straight into
    ``.grad`` (the fused accumulation). The profiler times that ``B``, not the hook-firing one
    that a data-parallel step's last piece runs."""
    from pipetrain.runtime.backward import deferred_wgrad

    fused: list[int] = []
    real = deferred_wgrad._accumulate
    monkeypatch.setattr(deferred_wgrad, "_accumulate", lambda *a: (fused.append(1), real(*a))[1])
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8).double(), nn.Linear(8, 8).double()]
    x = torch.randn(4, 8, dtype=torch.float64)
    profile(layers, x, repeats=1, warmup=0, context=1, in_flight=2)
    assert fused
