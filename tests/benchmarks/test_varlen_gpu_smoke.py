"""benchmarks/data/varlen_gpu.py's CPU dry run: ``pipetrain train`` on 2 gloo processes on a tiny
generated folder, both variants, the simulator's prediction written before the first run; the
``pipetrain profile`` command it would run; and the launches' rotation.

The dry run is given a costs file (``--costs``) of the tiny folder's 5 layers with made-up length
costs instead of profiling it: ``pipetrain profile --seq-lens`` profiles at three lengths, which
takes longer on 2 cores than the rest of the run, and is tested itself
(tests/cli/test_profile_lengths.py); its command line is checked here against the parser."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "data" / "varlen_gpu.py"


def made_up_costs(path: Path) -> None:
    """The tiny folder's layers (embedding, 2 blocks, norm, head) with length costs whose
    attention term matters at its 128-token rows."""
    from pipetrain.planner.costs_file import LayerCost, ModelCosts, save_costs

    names = ["embed", "block0", "block1", "norm", "head"]
    layers = tuple(
        LayerCost(
            name=name,
            forward=1.0,
            backward_input=1.0,
            backward_weight=1.0,
            backward=2.0,
            activation=1e-3,
            params=1e-3,
            per_token=0.01,
            per_token_sq=1e-4 if name.startswith("block") else 0.0,
        )
        for name in names
    )
    save_costs(ModelCosts(layers=layers, meta={"device": "cpu"}), path)


#: two gloo launches of pipetrain train and a folder built: 25-30 s on 2 cores, the stress tier;
#: the token budget's exactness and its report are in the default tier (tests/app/test_varlen_train.py)
@pytest.mark.stress
def test_the_cpu_smoke_preset_predicts_then_runs_both_variants(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    out = tmp_path / "out"
    env = {**os.environ, "VARLEN_WORK": str(tmp_path / "work"), "PYTHONPATH": str(ROOT)}
    made_up_costs(tmp_path / "costs.json")
    argv = [sys.executable, str(SCRIPT), "--preset", "cpu-smoke", "--out", str(out)]
    argv += ["--costs", str(tmp_path / "costs.json")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = done.stdout
    # the prediction comes before the first run, and names the aware run's token budget
    assert text.index("predicted before the runs") < text.index("fixed-0: -m pipetrain train")
    predicted = json.loads((out / "prediction.json").read_text())
    budget = predicted["global_batch_tokens"]
    assert budget == round(predicted["fixed"]["real_tokens"] / predicted["fixed"]["steps"])
    assert f"--global-batch-tokens {budget} --costs" in text
    for name in ("fixed", "aware"):
        assert predicted[name]["tok_per_s"] > 0 and predicted[name]["max_over_mean"] >= 1
        assert sum(predicted[name]["counts"].values()) == predicted[name]["steps"] == 3
    assert set(predicted["fixed"]["counts"]) == {"4"}  # -m 2 per rank x 2 ranks, every step
    # the runs' own metrics say the same counts: the prediction priced the steps they ran
    recorded = [json.loads(x)["microbatches"] for x in (out / "aware-0.metrics.jsonl").open()]
    planned = [int(k) for k, v in predicted["aware"]["counts"].items() for _ in range(v)]
    assert sorted(recorded) == planned
    result = json.loads((out / "varlen_gpu.json").read_text())
    assert [len(result["measured_tok_per_s"][v]) for v in ("fixed", "aware")] == [1, 1]
    ratio = result["ratio"]["aware"]
    assert ratio["launches"] == 1 and ratio["low"] <= ratio["estimate"] <= ratio["high"]
    assert result["ratio"]["fixed"]["estimate"] == 1.0
    losses = result["losses"]
    assert len(losses["fixed"]["losses"]) == len(losses["aware"]["losses"]) == 3
    assert losses["fixed"]["largest_difference"] == 0.0
    assert "losses of aware against fixed (3 steps" in text
    # balanced by the given costs' n² term: the aware run's micro-batches cost more alike
    assert predicted["aware"]["max_over_mean"] <= predicted["fixed"]["max_over_mean"]
    # a later call keeps a complete launch, and runs an incomplete one again
    from benchmarks.data.varlen_gpu import complete

    assert complete(out / "aware-0.metrics.jsonl", 3) == [
        json.loads(x) for x in (out / "aware-0.metrics.jsonl").open()
    ]
    assert complete(out / "aware-0.metrics.jsonl", 4) is None
    assert complete(out / "aware-9.metrics.jsonl", 3) is None


def test_the_profile_command_line_is_one_pipetrain_profile_accepts(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.data.varlen_gpu import PRESETS, profile_argv
    from pipetrain.cli import build_parser

    for name, preset in PRESETS.items():
        argv = profile_argv(preset, tmp_path / "model", tmp_path / "costs.json")
        args = build_parser().parse_args(argv)
        assert args.command == "profile" and args.seq_lens[-1] == preset["seq"], name


def test_every_variants_flags_are_ones_pipetrain_train_accepts(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.data.varlen_gpu import PRESETS, VARIANTS, common_flags, variant_flags
    from pipetrain.cli import build_parser

    p = PRESETS["llama-1b"]
    common = common_flags(p, 4, tmp_path / "text.txt", tmp_path / "model", tmp_path)
    seen = {}
    for name in VARIANTS:
        argv = ["train", *common, *variant_flags(name, p, 4, tmp_path / "c.json", 123456)]
        args = build_parser().parse_args(argv)
        seen[name] = (args.microbatches, args.microbatch_balance, args.global_batch_tokens)
    assert seen == {
        "fixed": (16, "fixed", None),
        "aware": (None, "length", 123456),
        "balanced": (16, "length", None),
    }


def test_launches_rotate_which_variant_runs_first() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.data.varlen_gpu import rounds

    two = rounds(3, ["fixed", "aware"])
    assert two == [
        (0, "fixed"),
        (0, "aware"),
        (1, "aware"),
        (1, "fixed"),
        (2, "fixed"),
        (2, "aware"),
    ]
    three = [name for r, name in rounds(3, ["fixed", "aware", "balanced"]) if r == 1]
    assert three == ["aware", "balanced", "fixed"]
