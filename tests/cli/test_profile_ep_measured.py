"""``pipetrain profile --ep E --ep-measure processes``: the dispatch and the expert link
measured on E gloo worker processes. The bytes each MoE layer's dispatch sends to the other
rank are checked against the unsplit model's own routing of each rank's micro-batch (the
router's top-k choices, counted here), the link is a measured positive GB/s, and ``plan``
prices the file; a given link wins over the measured one; what cannot be measured as asked is
refused."""

from __future__ import annotations

import pytest
import torch
from finetune_cases import PROFILE_MOE, write_profile_mixtral

from pipetrain.cli import main
from pipetrain.planner.costs_file import load_costs

QUICK = ["--repeats", "1", "--context", "1", "--device", "cpu"]
HIDDEN, TOP_K, EXPERTS, VOCAB = (PROFILE_MOE[k] for k in ("hidden", "top_k", "experts", "vocab"))
ROWS, SEQ = 2, 8
SHAPE = ["--seq-len", str(SEQ), "--microbatch-size", str(ROWS), "--dtype", "float64"]


def rows_to_the_other_rank(folder) -> list[int]:
    """Per decoder layer, the most rows one of two ranks (experts 0-1 and 2-3) sends the other:
    the unsplit model's router choices on each rank's micro-batch (tokens drawn from its rank as
    the seed)."""
    import transformers

    model = transformers.MixtralForCausalLM.from_pretrained(
        folder, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    chosen: list[torch.Tensor] = []
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.register_forward_hook(lambda _m, args, _out: chosen.append(args[1].flatten()))
    sent = []
    for rank in (0, 1):
        chosen.clear()
        gen = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            model(torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen))
        owner = [ids // (EXPERTS // 2) for ids in chosen]  # rank 0 holds experts 0, 1
        sent.append([int((o != rank).sum()) for o in owner])
    return [max(per_rank) for per_rank in zip(*sent, strict=True)]


def test_processes_measure_the_real_dispatch_and_the_link(tmp_path, capsys) -> None:
    folder = tmp_path / "mixtral"
    write_profile_mixtral(folder, seed=1)
    out = tmp_path / "costs.json"
    argv = ["profile", "--model-dir", str(folder), *SHAPE, *QUICK, "--out", str(out)]
    assert main([*argv, "--ep", "2", "--ep-measure", "processes"]) == 0
    said = capsys.readouterr().out
    assert "expert parallel 2: 2 MoE layers dispatch up to" in said
    assert "(measured on gloo on CPU processes, one process per rank)" in said
    assert "GB/s (measured)" in said
    costs = load_costs(out)
    ep = costs.meta["ep"]
    assert ep["dispatched_bytes"] == "measured" and ep["link"] == "measured"
    rows = rows_to_the_other_rank(folder)
    assert ep["rows"] == {"1": rows[0], "2": rows[1]}
    by_name = {x.name: x.dispatched_bytes for x in costs.layers}
    assert by_name == {
        "model.embed_tokens": None,
        "model.layers.0": rows[0] * HIDDEN * 8,  # float64 rows of HIDDEN values
        "model.layers.1": rows[1] * HIDDEN * 8,
        "model.norm": None,
        "lm_head": None,
    }
    assert costs.ep_link_gbs is not None and costs.ep_link_gbs > 0
    middle = ep["link_points"][1]
    assert costs.ep_link_gbs == middle["gbs"] == pytest.approx(middle["bytes"] / middle["ms"] / 1e6)
    assert middle["bytes"] == pytest.approx(max(rows) * HIDDEN * 8, rel=0.2)
    assert main(["plan", "--costs", str(out), "-p", "2", "--memory-gib", "4"]) == 0
    assert "all-to-all" in capsys.readouterr().out


def test_a_given_link_wins_over_the_measured_one(monkeypatch) -> None:
    """The measurement replaced by a known result: what the choice writes, and which link."""
    import argparse

    from pipetrain.cli.profile_ep_choice import EpChoice, ep_line
    from pipetrain.planner.costs_file import uniform_costs
    from pipetrain.runtime.profile import profile_ep_measured

    measured = profile_ep_measured.EpMeasured(
        dispatched_bytes={1: 640.0, 2: 384.0}, rows={1: 10, 2: 6}, link_gbs=3.0
    )
    monkeypatch.setattr(profile_ep_measured, "measure_expert_parallel", lambda *a, **k: measured)
    choice = EpChoice(moe_layers=[1, 2], why_derived="", group="gloo on CPU processes")
    costs = uniform_costs(["embed", "moe0", "moe1", "head"])
    args = argparse.Namespace(ep=2, ep_link_gbs=None, repeats=1)
    found = choice.apply(args, None, costs, torch.device("cpu"))
    assert found.ep_link_gbs == 3.0 and found.meta["ep"]["link"] == "measured"
    args.ep_link_gbs = 50.0
    given = choice.apply(args, None, costs, torch.device("cpu"))
    assert given.ep_link_gbs == 50 and given.meta["ep"]["link"] == "given"
    assert given.meta["ep"]["measured_link_gbs"] == 3.0
    assert [x.dispatched_bytes for x in given.layers] == [None, 640.0, 384.0, None]
    assert ep_line(given) == (
        "expert parallel 2: 2 MoE layers dispatch up to 0.00064 MB each per micro-batch "
        "(measured on gloo on CPU processes) at 50 GB/s (given)"
    )


def test_what_cannot_be_measured_as_asked_is_refused(tmp_path, capsys, monkeypatch) -> None:
    folder = tmp_path / "mixtral"
    write_profile_mixtral(folder, seed=1)
    argv = ["profile", "--model-dir", str(folder), *SHAPE, *QUICK]
    assert main([*argv, "--ep-measure", "processes"]) == 2
    err = capsys.readouterr().err
    assert "--ep-measure processes applies to expert parallel: give --ep E above 1" in err
    assert main([*argv, "--ep", "3", "--ep-measure", "processes"]) == 2
    err = capsys.readouterr().err
    assert "--ep-measure processes: --ep 3 does not divide the number of experts (4)" in err
    gpu = ["profile", "--model-dir", str(folder), *SHAPE, "--device", "cuda"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main([*gpu, "--ep", "2", "--ep-measure", "processes"]) == 2  # refused before timing
    assert "--ep-measure processes: --ep 2 needs 2 GPUs, 1 visible" in capsys.readouterr().err
