"""``python -m pipetrain.app.hf_train``: flags checked before any process, stage counts, and a
short in-process run (one rank) whose loss goes down on the generated corpus."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("transformers")

from pipetrain.app import hf_train


def _args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    hf_train.add_arguments(parser)
    args = parser.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    args.argv = []
    return args


@pytest.mark.parametrize("blocks,stages", [(4, 2), (2, 4), (5, 8), (1, 4), (6, 3)])
def test_stage_counts_cover_every_layer_once(blocks, stages):
    counts = hf_train.stage_layer_counts(blocks, stages)
    assert len(counts) == stages and sum(counts) == blocks + 3 and min(counts) >= 1


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"dp": 0}, "--dp must be >= 1"),
        ({"schedule": "dualpipe"}, "two copies"),
        ({"schedule": "zbv", "ranks": 4, "layers": 4}, "use --layers >= 5"),
        ({"hidden": 30}, "multiple of --heads"),
        ({"text": "/no/such/file"}, "no such file"),
    ],
)
def test_bad_flags_exit_2_before_any_process(overrides, message, capsys):
    assert hf_train.run(_args(**overrides)) == 2
    assert message in capsys.readouterr().err


def test_one_rank_run_trains_on_the_corpus_file(tmp_path, capsys):
    import torch
    import torch.distributed as dist
    from runtime_harness import free_port

    args = _args(
        ranks=1,
        dp=1,
        steps=12,
        layers=1,
        hidden=32,
        seq_len=16,
        microbatches=2,
        corpus_out=str(tmp_path / "corpus.txt"),
        svg=str(tmp_path / "step.svg"),
    )
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        assert hf_train.train(args, torch.device("cpu")) == 0
    finally:
        dist.destroy_process_group()
    out = capsys.readouterr().out
    assert "the loss went DOWN" in out and (tmp_path / "corpus.txt").stat().st_size > 100_000
