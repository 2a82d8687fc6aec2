"""``pipetrain train`` on a real model (a tiny Hugging Face Llama from a config): the default
cut, a one-rank run on the corpus file, ``Pipeline.from_plan`` against the unsplit model, and
``--resume`` continuing bit for bit (float64, gloo, 2 ranks, one launch); and the chain
``profile → plan → train --plan`` (with tied embeddings, clipping, checkpoints and a resume)
from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from runtime_harness import launch
from train_cases import ALONE, from_plan_gradients, pipeline_alone_losses, resume_runs, train_args

from pipetrain.app.catalog import default_stage_layers


@pytest.mark.parametrize("model", ["gpt", "llama"])
@pytest.mark.parametrize("blocks,stages", [(4, 2), (2, 4), (5, 8), (1, 4), (6, 3), (8, 8)])
def test_the_default_cut_covers_every_layer_once(model, blocks, stages):
    extra = 2 if model == "gpt" else 3
    if stages > blocks + extra:
        with pytest.raises(ValueError, match="stages for"):
            default_stage_layers(model, blocks, stages)
        return
    counts = default_stage_layers(model, blocks, stages)
    assert len(counts) == stages and sum(counts) == blocks + extra and min(counts) >= 1
    assert max(counts) - min(counts) <= extra  # balanced up to the embedding and head


def test_one_rank_run_trains_on_the_corpus_file(tmp_path, monkeypatch):
    """And closes its pipeline before returning: the worker destroys its process group next,
    which waits forever on NCCL while a captured step (``--cuda-graph``) is alive."""
    import torch
    import torch.distributed as dist
    from runtime_harness import free_port

    from pipetrain.app.train import train
    from pipetrain.runtime.pipeline import Pipeline

    made: list[Pipeline] = []
    build = Pipeline.__init__

    def tracked(self, *args, **kwargs) -> None:
        made.append(self)
        build(self, *args, **kwargs)

    monkeypatch.setattr(Pipeline, "__init__", tracked)

    args = train_args(
        *("-p", "1", "-m", "2", "--steps", "12", "--layers", "1", "--hidden", "32"),
        *("--seq-len", "16", "--corpus-out", str(tmp_path / "corpus.txt")),
        *("--svg", str(tmp_path / "step.svg")),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        run = train(args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert "the loss went DOWN" in run.report and "simulated step" in run.report
    assert (tmp_path / "corpus.txt").stat().st_size > 100_000
    assert len(run.losses) == 12 and run.first_step == 0
    assert len(made) == 1 and made[0].closed


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of 2 ranks for the tests below: (from_plan's gradients, the resume runs, the
    losses of ``pipetrain train``'s loop on the pipeline alone) on each rank."""
    directory = str(tmp_path_factory.mktemp("two_ranks"))
    return launch(2, _two_ranks, directory, timeout=300)


def _two_ranks(rank, world, directory):
    alone = pipeline_alone_losses(directory)
    return from_plan_gradients(rank, world), resume_runs(rank, world, directory), alone


def test_from_plan_matches_the_unsplit_model_and_resume_is_bit_identical(two_ranks):
    """from_plan (a plan dict on zbv, a ``Plan`` on 1f1b) against the unsplit Llama in float64,
    and a plan for 4 ranks refused; then ``pipetrain train``'s loop (tied embeddings, clipping,
    float64): 4 steps straight against 2 steps, a checkpoint and a resume to step 4 — the same
    losses and parameters, bit for bit."""
    results = [r[:2] for r in two_ranks]
    for planned, resumed in results:
        for label, error in planned["errors"].items():
            assert error < 1e-12, (label, error)
        assert "the plan is for 4 pipeline ranks but the process group has 2" in planned["refusal"]
        first_step, tail = resumed["resumed"]
        assert first_step == 2 and len(tail) == 2
        assert resumed["first"] + tail == resumed["straight"]  # float equality
        assert resumed["tensors"] > 0 and resumed["differ"] == []
    assert "the loss went DOWN" in results[0][1]["report"]


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    cmd = [sys.executable, "-m", "pipetrain", *argv]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


def test_profile_plan_train_chain_with_a_checkpoint_and_resume(tmp_path, capsys, monkeypatch):
    """``pipetrain profile --model llama > costs.json``, ``pipetrain plan ... --json >
    plan.json`` (in this process), then ``pipetrain train --plan plan.json`` (2 processes) with
    checkpoints, a resume, and (in this process) a resume refused for another model."""
    import torch

    from pipetrain.cli import main

    monkeypatch.chdir(tmp_path)
    model = ["--model", "llama", "--layers", "2", "--hidden", "16", "--seq-len", "16"]
    model += ["--tie-embeddings", "--microbatch-size", "2"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["profile", *model, "--repeats", "1", "--device", "cpu"]) == 0
    finally:
        torch.set_num_threads(threads)
    costs = capsys.readouterr().out
    (tmp_path / "costs.json").write_text(costs)
    names = [layer["name"] for layer in json.loads(costs)["layers"]]
    assert names == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm",
                     "lm_head"]  # fmt: skip
    plan = ["plan", "--costs", "costs.json", "--ranks", "2", "--memory-gib", "1", "--json"]
    assert main([*plan, "--schedules", "1f1b,zbv,zb-h1", "--microbatches", "4"]) == 0
    (tmp_path / "plan.json").write_text(capsys.readouterr().out)
    train = ["train", *model, "--plan", "plan.json", "--clip-grad-norm", "1"]
    train += ["--checkpoint-dir", "ckpt", "--checkpoint-every", "2", "--timeout", "60"]
    done = _cli(*train, "--steps", "3", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "(plan plan.json)" in done.stdout and "grad norm" in done.stdout
    assert "measured step" in done.stdout and "simulated step" in done.stdout
    planned = json.loads((tmp_path / "plan.json").read_text())["predicted"]["step_ms"]
    assert f"planned step:    makespan {planned:8.2f} ms" in done.stdout, done.stdout
    assert "2 processes of one thread each share" in done.stdout  # why they differ on a CPU
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-000003"
    assert (tmp_path / "ckpt" / "step-000002").is_dir()
    done = _cli(*train, "--steps", "4", "--resume", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 4/4" in done.stdout and "step 3/4" not in done.stdout
    # another model cannot resume from it: exit 2, the flag named, no traceback
    other = [*train[:6], "32", *train[7:]]
    assert other[5:7] == ["--hidden", "32"]
    # (in this process: the launcher refuses before any process starts)
    assert main([*other, "--steps", "5", "--resume"]) == 2
    said = capsys.readouterr().err
    assert "--hidden 16 there, 32 here" in said and "Traceback" not in said


def _losses(out: str) -> list[float]:
    return [
        float(line.split("loss ")[1].split()[0]) for line in out.splitlines() if "] loss " in line
    ]


@pytest.mark.slow
def test_train_with_tensor_parallel_follows_the_same_losses(tmp_path, two_ranks):
    """`pipetrain train --tp 2` (4 processes: 2 pipeline × 2 tensor parallel, sequence parallel)
    trains the same float64 model to the same losses as the pipeline alone (``ALONE``: the
    same flags without ``--tp``, run by the command's training loop in the 2-rank launch)."""
    common = ("train", *ALONE, "--svg", str(tmp_path / "s.svg"))
    common += ("--corpus-out", str(tmp_path / "c.txt"))
    split = _cli(*common, "--tp", "2", "--sequence-parallel", cwd=tmp_path)
    assert split.returncode == 0, split.stderr
    assert "2 pipeline × 1 data parallel × 2 tensor parallel" in split.stdout
    want, got = two_ranks[0][2], _losses(split.stdout)
    assert want == two_ranks[1][2] and len(want) == 3 and len(got) == 3
    assert all(abs(a - b) < 1e-4 for a, b in zip(want, got)), (want, got)
