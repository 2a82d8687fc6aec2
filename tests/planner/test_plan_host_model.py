"""An eager profile's host and device times in the planner: the costs file carries them, a stage
sums them, recompute divides its time between them, and the simulator paces each rank by both
(``sim.costs``, ``schedule.execute``)."""

from __future__ import annotations

import dataclasses

import pytest

from pipetrain.planner import ModelCosts, parse_costs
from pipetrain.planner.costs_file import CostsFileError, LayerCost, load_costs, save_costs
from pipetrain.planner.recompute import recomputed_layer
from pipetrain.planner.recompute_modes import Recompute
from pipetrain.planner.search import simulate_plan, stage_costs
from pipetrain.schedule.registry import build_schedule

PIECES = ("forward", "backward", "backward_input", "backward_weight")


def _layer(name: str, host: float, device: float, **extra: float) -> LayerCost:
    """Wall times f 1, I 1, W 1 (B 2); the host's and the device's are shares of them."""
    wall = {"forward": 1.0, "backward": 2.0, "backward_input": 1.0, "backward_weight": 1.0}
    return LayerCost(
        name=name, activation=0.1, params=0.1, **wall,  # type: ignore[arg-type]
        **{f"host_{k}": v * host for k, v in wall.items()},
        **{f"device_{k}": v * device for k, v in wall.items()},
        **extra,
    )  # fmt: skip


def _model(host: float, device: float, layers: int = 8) -> ModelCosts:
    return ModelCosts(layers=tuple(_layer(f"l{i}", host, device) for i in range(layers)))


def test_the_costs_file_carries_host_and_device_times(tmp_path) -> None:
    costs = _model(0.9, 0.4)
    save_costs(costs, tmp_path / "c.json")
    again = load_costs(tmp_path / "c.json")
    assert again == costs and again.has_issue_times
    raw = costs.to_json()
    del raw["layers"][3]["device_backward_weight"]
    with pytest.raises(CostsFileError, match=r"layers\[3\]\.device_backward_weight: missing"):
        parse_costs(raw)
    raw["version"] = 1
    with pytest.raises(CostsFileError, match="version 2 field"):
        parse_costs(raw)


def test_a_stage_sums_its_layers_host_and_device_times() -> None:
    program = build_schedule("1f1b", 2, 4)
    sc = stage_costs(_model(0.9, 0.4), program, (5, 3)).per_stage(2)
    assert sc.host is not None and sc.device is not None
    assert sc.host.forward == pytest.approx((4.5, 2.7))
    assert sc.device.backward_weight == pytest.approx((2.0, 1.2))
    # one layer without them: no host model for any stage
    partly = ModelCosts(
        layers=(_layer("x", 1, 1), dataclasses.replace(_layer("y", 1, 1), host_forward=None))
    )
    assert stage_costs(partly, program, (1, 1)).host is None


def test_recompute_divides_its_time_as_the_forward_does() -> None:
    layer = _layer("block", 0.9, 0.4, recompute=2.0, recompute_forward=0.3)
    full = recomputed_layer(layer, Recompute.FULL)
    # the recompute's 2 ms: 0.9 of it the host's, 0.4 the device's; all in I, none in W
    assert full.host_backward == full.host_backward_input == pytest.approx(1.8 + 1.8)
    assert full.device_backward == full.device_backward_input == pytest.approx(0.8 + 0.8)
    assert full.host_backward_weight == full.device_backward_weight == 0.0
    assert full.host_forward == pytest.approx(0.9 + 0.3)  # bookkeeping: the host's
    assert full.device_forward == pytest.approx(0.4)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "interleaved-1f1b"])
def test_a_host_bound_step_is_paced_by_its_hosts(schedule) -> None:
    """A host that takes the whole wall time and a device that needs little: each rank's step is
    at least its host's sum, and no longer than the wall-time model; with the host free and the
    device taking the wall time, the model is the wall-time model."""
    program = build_schedule(schedule, 2, 8, 2 if schedule.startswith("interleaved") else 1)
    cut = (2, 2, 2, 2) if program.num_stages == 4 else (4, 4)
    wall = dataclasses.replace(_model(1.0, 1.0), layers=tuple(
        dataclasses.replace(x, **{f"{w}_{k}": None for w in ("host", "device") for k in PIECES})
        for x in _model(1.0, 1.0).layers))  # fmt: skip
    plain, _ = simulate_plan(wall, program, cut)
    hosted, _ = simulate_plan(_model(1.0, 0.2), program, cut)
    free_host, _ = simulate_plan(_model(0.0, 1.0), program, cut)
    assert free_host.spans == plain.spans
    host_sum = 8 * 3 * 4  # per rank: 8 micro-batches × (F + I + W) of 4 layers
    assert host_sum <= hosted.makespan <= plain.makespan + 1e-9
    assert hosted.makespan < plain.makespan  # the device's short work hides the pipeline's fill


def test_the_runtimes_own_host_time_per_action_delays_every_issue(tmp_path) -> None:
    """``host_action_ms``: what the pipeline's host spends per action besides issuing it (posting
    transfers, bookkeeping); a host-bound rank's step grows by it once per action."""
    program = build_schedule("1f1b", 1, 4)
    costs = dataclasses.replace(_model(1.0, 0.2, layers=2), host_action_ms=0.25)
    save_costs(costs, tmp_path / "c.json")
    assert load_costs(tmp_path / "c.json").host_action_ms == 0.25
    sc = stage_costs(costs, program, (2,)).per_stage(1)
    assert sc.host is not None and sc.device is not None
    assert sc.host.forward == pytest.approx((2.25,)) and sc.device.forward == pytest.approx((0.4,))
    bare, _ = simulate_plan(dataclasses.replace(costs, host_action_ms=None), program, (2,))
    slower, _ = simulate_plan(costs, program, (2,))
    assert slower.makespan == pytest.approx(bare.makespan + 0.25 * 7)  # 8 actions, last no wait


def test_cli_plan_uses_the_host_model_for_eager_steps_only(tmp_path, capsys) -> None:
    """``pipetrain plan`` simulates an eager step with the profile's host times and says when
    the runtime's own per-action host time is missing; with ``--cuda-graph`` (a replay issues
    nothing per action) it plans from the wall times alone, as from a profile without them."""
    import json

    from pipetrain.cli import main

    hosted = _model(1.0, 0.2)
    bare = hosted.without_issue_times()
    assert not bare.has_issue_times and bare.host_action_ms is None
    paths = {}
    for name, costs in (("hosted", hosted), ("bare", bare)):
        paths[name] = tmp_path / f"{name}.json"
        save_costs(costs, paths[name])

    def pick(name: str, *extra: str) -> tuple[dict, str]:
        code = main(["plan", "--costs", str(paths[name]), "--ranks", "2", "--memory-gib", "100",
                     "--json",
                     *extra])  # fmt: skip
        out = capsys.readouterr()
        assert code == 0, out.err
        return json.loads(out.out), out.err

    eager, note = pick("hosted")
    assert "no host_action_ms" in note
    graphed, graphed_note = pick("hosted", "--cuda-graph")
    assert "host_action_ms" not in graphed_note
    assert graphed == pick("bare", "--cuda-graph")[0]
    assert eager["predicted"]["step_ms"] < pick("bare")[0]["predicted"]["step_ms"]
    # the runtime's own host time per action, from the command line (a train run's host: line)
    slower, quiet = pick("hosted", "--host-action-ms", "0.5")
    assert "host_action_ms" not in quiet
    assert slower["predicted"]["step_ms"] > eager["predicted"]["step_ms"]
    with pytest.raises(SystemExit) as bad:
        main(["plan", "--costs", str(paths["hosted"]), "--ranks", "2", "--memory-gib", "100",
              "--host-action-ms", "-1"])  # fmt: skip
    assert bad.value.code == 2
    assert "expected a number of ms >= 0" in capsys.readouterr().err


def test_the_profile_command_says_which_half_an_eager_step_waits_for() -> None:
    from pipetrain.cli.profile_command import issue_line

    line = issue_line(_model(0.9, 0.4, layers=2))
    assert "host 5.400 ms, device 2.400 ms" in line and "host-bound" in line
    assert "device-bound" in issue_line(_model(0.2, 0.9, layers=2))
