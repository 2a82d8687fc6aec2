"""``pipetrain profile --ep E --ep-link-gbs G`` on a mixture-of-experts folder: each MoE layer's
dispatched bytes (derived from the config and the micro-batch) and the link go into the costs
file, which ``pipetrain plan`` prices; a dense model or a link without ``--ep`` is refused."""

from __future__ import annotations

from finetune_cases import PROFILE_MOE, write_profile_mixtral

from pipetrain.cli import main
from pipetrain.planner.costs_file import load_costs
from pipetrain.planner.costs_file_moe import dispatched_bytes

QUICK = ["--repeats", "1", "--context", "1", "--device", "cpu"]
HIDDEN, TOP_K = PROFILE_MOE["hidden"], PROFILE_MOE["top_k"]


def test_profile_writes_the_moe_layers_dispatch_and_plan_prices_it(tmp_path, capsys) -> None:
    folder = tmp_path / "mixtral"
    write_profile_mixtral(folder)
    out = tmp_path / "costs.json"
    argv = ["profile", "--model-dir", str(folder), "--seq-len", "8", "--microbatch-size", "2"]
    assert main([*argv, *QUICK, "--ep", "2", "--ep-link-gbs", "50", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "expert parallel 2: 2 MoE layers dispatch" in said and "at 50 GB/s" in said
    costs = load_costs(out)
    expected = 2 * 8 * TOP_K * HIDDEN * 4 / 2  # tokens · top-k · hidden · float32 bytes · 1/2
    assert expected == dispatched_bytes(16, TOP_K, HIDDEN, 4, 2)
    by_name = {x.name: x.dispatched_bytes for x in costs.layers}
    assert by_name == {
        "model.embed_tokens": None,
        "model.layers.0": expected,
        "model.layers.1": expected,
        "model.norm": None,
        "lm_head": None,
    }
    assert costs.ep_link_gbs == 50 and costs.meta["ep"] == {
        "degree": 2,
        "link": "given",
        "dispatched_bytes": "derived",
        "why_derived": "on a CPU (--ep-measure processes to measure on gloo processes anyway)",
    }
    assert main(["plan", "--costs", str(out), "-p", "2", "--memory-gib", "4"]) == 0
    assert "all-to-all" in capsys.readouterr().out


def test_expert_dispatch_is_refused_where_nothing_dispatches(tmp_path, capsys) -> None:
    folder = tmp_path / "mixtral"
    write_profile_mixtral(folder)
    gpt = ["--model", "gpt", "--layers", "1", "--hidden", "8", "--heads", "2", "--vocab", "32"]
    assert main(["profile", *gpt, *QUICK, "--ep", "2"]) == 2
    assert "gpt has no mixture-of-experts layers" in capsys.readouterr().err
    link_only = ["profile", "--model-dir", str(folder), "--seq-len", "8", "--ep-link-gbs", "50"]
    assert main([*link_only, *QUICK]) == 2
    assert "--ep-link-gbs prices expert parallel: give --ep E above 1" in capsys.readouterr().err
