"""The costs file's mixture-of-experts fields (``dispatched_bytes``, ``ep_link_gbs``) and the
planner pricing the expert all-to-all from them: every older version still loads, bad values are
refused naming the field, and a large all-to-all moves the pick towards DualPipeV."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipetrain.cli import main
from pipetrain.planner.costs_file import (
    CostsFileError,
    LayerCost,
    ModelCosts,
    parse_costs,
    save_costs,
)
from pipetrain.planner.costs_file_moe import all_to_all_ms, unpriced_note, with_ep_link
from pipetrain.planner.judge import stage_costs
from pipetrain.planner.search import search
from pipetrain.schedule.registry import build_schedule


def moe_model(dispatched: float, link: float | None = 50.0, layers: int = 8) -> ModelCosts:
    """``layers`` equal layers, every other one a mixture-of-experts layer."""
    return ModelCosts(
        layers=tuple(
            LayerCost(
                name=f"b{i}",
                forward=1.0,
                backward_input=1.0,
                backward_weight=1.0,
                backward=2.0,
                activation=0.1,
                params=0.1,
                dispatched_bytes=dispatched if i % 2 else None,
            )
            for i in range(layers)
        ),
        comm=0.01,
        ep_link_gbs=link,
    )


def _v1_layer() -> dict[str, object]:
    return {"name": "a", "forward": 1, "backward": 2, "activation": 0.5, "params": 1}


@pytest.mark.parametrize(
    "version, extra",
    [
        (1, {}),
        (2, {"recompute": 1.0, "per_token": 0.1, "per_token_sq": 0.0}),
        (3, {"gradients": 0.25}),
        (3, {"dispatched_bytes": 4e8}),
    ],
)
def test_every_version_still_loads(version: int, extra: dict[str, object]) -> None:
    top = {"ep_link_gbs": 50} if "dispatched_bytes" in extra else {}
    data = {"version": version, "layers": [_v1_layer() | extra], "comm": 0.1, **top}
    costs = parse_costs(data)
    assert costs.layers[0].dispatched_bytes == extra.get("dispatched_bytes")
    assert costs.ep_link_gbs == top.get("ep_link_gbs")
    again = parse_costs(json.loads(json.dumps(costs.to_json())))
    assert again == costs  # written as version 3, read back the same


@pytest.mark.parametrize(
    "change, where, problem",
    [
        ({"version": 2}, "layers[0].dispatched_bytes", "a version 3 field in a version 2 file"),
        ({"dispatched_bytes": -1}, "layers[0].dispatched_bytes", "expected a finite number"),
        ({"dispatched_bytes": "4e8"}, "layers[0].dispatched_bytes", "expected a number"),
        ({"ep_link_gbs": 0}, "ep_link_gbs", "expected GB/s > 0"),
        ({"ep_link_gbs": True}, "ep_link_gbs", "expected a number"),
    ],
)
def test_bad_values_name_the_field(change: dict[str, object], where: str, problem: str) -> None:
    layer = _v1_layer() | {"dispatched_bytes": 1e6}
    data: dict[str, object] = {"version": 3, "layers": [layer]}
    for key, value in change.items():
        if key == "dispatched_bytes":
            layer[key] = value
        else:
            data[key] = value
    with pytest.raises(CostsFileError, match=re.escape(f"costs: {where}: {problem}")):
        parse_costs(data)


def test_a_stage_waits_for_its_layers_dispatch_and_combine() -> None:
    assert all_to_all_ms(5e8, 50.0) == 20.0  # 2 x 0.5 GB at 50 GB/s
    costs = moe_model(5e7, layers=6)
    program = build_schedule("1f1b", 2, 4)
    sim = stage_costs(costs, program, (4, 2))
    assert sim.all_to_all == [4.0, 2.0]  # two and one MoE layers at 2 ms each
    unpriced = stage_costs(moe_model(5e7, link=None, layers=6), program, (4, 2))
    assert unpriced.all_to_all == [0.0, 0.0]
    assert "no ep_link_gbs" in unpriced_note(moe_model(5e7, link=None))
    assert unpriced_note(costs) == ""


def test_a_link_for_a_dense_model_is_refused() -> None:
    dense = moe_model(0.0, link=None)
    with pytest.raises(ValueError, match="--ep-link-gbs: no layer of the costs file"):
        with_ep_link(dense, 50.0)
    assert with_ep_link(dense, None) is dense
    assert with_ep_link(moe_model(1e6, link=None), 25.0).ep_link_gbs == 25.0


def test_a_large_all_to_all_makes_dualpipev_relatively_better() -> None:
    families = ["1f1b", "interleaved-1f1b", "zbv", "dualpipev"]

    def steps(dispatched: float) -> dict[str, float]:
        found = search(
            moe_model(dispatched),
            num_ranks=2,
            memory_gib=100,
            microbatches=[8],
            schedules=families,
        )
        return {c.plan.schedule: c.plan.step_ms for c in found.best_per_family()}

    dense, moe = steps(0.0), steps(1e7)
    assert min(dense, key=dense.__getitem__) != "dualpipev"  # no all-to-all: nothing to hide
    assert min(moe, key=moe.__getitem__) == "dualpipev"
    for other in ("1f1b", "interleaved-1f1b", "zbv"):
        assert moe["dualpipev"] / moe[other] < dense["dualpipev"] / dense[other]


def test_cli_prices_the_all_to_all_and_refuses_what_it_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "costs.json"
    save_costs(moe_model(1e7, link=None), path)
    argv = ["plan", "--costs", str(path), "-p", "2", "-m", "8", "--memory-gib", "100"]
    assert main(argv) == 0
    assert "not priced" in capsys.readouterr().err
    assert main([*argv, "--ep-link-gbs", "50", "--schedules", "zbv,dualpipev"]) == 0
    out = capsys.readouterr().out
    assert "plan: dualpipev" in out and "all-to-all at 50 GB/s" in out and "% hidden" in out
    save_costs(moe_model(0.0, link=None), path)
    assert main([*argv, "--ep-link-gbs", "50"]) == 2
    assert "no layer of the costs file has dispatched_bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's exit: a one-line usage error
        main([*argv, "--ep-link-gbs", "0"])
    assert refused.value.code == 2 and "expected a number > 0" in capsys.readouterr().err
    sim = ["simulate", "dualpipev", "-p", "2", "-m", "4"]
    assert main([*sim, "--dispatched-bytes", "1e8"]) == 2
    assert "give --dispatched-bytes and --ep-link-gbs together" in capsys.readouterr().err
    assert main([*sim, "--all-to-all", "1", "--dispatched-bytes", "1e8", "--ep-link-gbs", "5"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([*sim, "--dispatched-bytes", "1e7", "--ep-link-gbs", "10", "--json"]) == 0
    moved = json.loads(capsys.readouterr().out)["all_to_all"]
    # 1e7 bytes at 10 GB/s: 2 ms each way; 4 micro-batches x 2 stages x (2 + 2 ms) per rank
    assert moved["total"] == [32.0, 32.0]
    assert 0 < moved["hidden_share"] < 1
