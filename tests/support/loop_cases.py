"""Per-rank runners for ``pipetrain train``'s loop (``test_train_loop``): the learning-rate
schedule, the metrics file and the evaluation, on 2 gloo ranks in float64, in one launch.

``schedule_and_eval_runs``: the built-in GPT trained 6 steps straight (cosine with warm-up,
weight decay, ``--metrics``, ``--eval-data``), then 6 steps with checkpoints that are cut back to
step 2 as if the run had stopped there after writing 3 more metrics lines, then resumed to step
6; rank 0 also computes the held-out loss of the straight run's final weights with the unsplit
model. ``fine_tune_defaults_run``: a tiny Llama folder fine-tuned with the default optimizer flags,
its held-out loss checked against ``transformers``' model loaded from the exported folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

TINY = [
    "--model",
    "gpt",
    "--layers",
    "2",
    "--hidden",
    "16",
    "--heads",
    "2",
    "--seq-len",
    "16",
    "--dtype",
    "float64",
    "-m",
    "2",
    "--microbatch-size",
    "2",
    "--timeout",
    "60",
]


def train_args(*argv: str):
    from pipetrain.cli.train_command import config_from_argv

    return config_from_argv(argv)


def _texts(directory: Path, rank: int) -> tuple[str, str]:
    """A training text and a held-out one (written by rank 0)."""
    from pipetrain.app.models.data import make_corpus

    train_text, eval_text = directory / "train.txt", directory / "eval.txt"
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        train_text.write_bytes(make_corpus(4096))
        eval_text.write_bytes(make_corpus(300, seed=99))
    dist.barrier()
    return str(train_text), str(eval_text)


def schedule_and_eval_runs(rank: int, world: int, directory: str) -> dict:
    from pipetrain.app.metrics import read_metrics
    from pipetrain.app.train import train

    root = Path(directory)
    train_text, eval_text = _texts(root, rank)
    common = [
        *TINY,
        "--steps",
        "6",
        "--lr-schedule",
        "cosine",
        "--warmup",
        "2",
        "--min-lr",
        "1e-4",
        "--weight-decay",
        "0.1",
        "--data",
        train_text,
        "--eval-data",
        eval_text,
        "--eval-every",
        "3",
        "--svg",
        f"{directory}/step.svg",
    ]
    cpu = torch.device("cpu")
    straight = train(train_args(*common, "--metrics", f"{directory}/straight.jsonl"), cpu)
    resumed_file = f"{directory}/resumed.jsonl"
    ckpt = ["--checkpoint-dir", f"{directory}/ckpt", "--metrics", resumed_file]
    train(train_args(*common, *ckpt, "--checkpoint-every", "2"), cpu)
    if rank == 0:  # as if the run had stopped after step 5's metrics line, with step 2 saved
        for step in (4, 6):
            shutil.rmtree(root / "ckpt" / f"step-{step:06d}")
        (root / "ckpt" / "latest").write_text("step-000002")
        lines = Path(resumed_file).read_text().splitlines(keepends=True)
        Path(resumed_file).write_text("".join(lines[:5]) + lines[5][:10])  # a line cut short
    dist.barrier()
    resumed = train(train_args(*common, *ckpt, "--resume"), cpu)
    result: dict = {"straight": straight.losses, "resumed": (resumed.first_step, resumed.losses)}
    states: list = [None] * world
    dist.all_gather_object(states, straight.state)
    if rank == 0:
        result["straight_metrics"] = read_metrics(f"{directory}/straight.jsonl")
        result["resumed_metrics"] = read_metrics(resumed_file)
        result["reference_eval"] = _gpt_eval_loss(common, states, eval_text)
        result["report"] = straight.report
        result["chart"] = Path(f"{directory}/straight.svg").read_text()
    return result


def _gpt_eval_loss(common: list[str], states: list[dict], eval_text: str) -> float:
    """The token-mean loss of the eval text's windows (stride --seq-len, each byte after the
    first predicted once) under the unsplit GPT holding the gathered weights."""
    from pipetrain.app.catalog import build

    config = train_args(*common)
    model = build(config.shape)
    state = {k: v for part in states for k, v in part.items()}
    layers = []
    for i in range(len(model.names)):
        layer = model.layers(i)  # the built-in GPT: a factory, its layers named layers.<index>
        prefix = f"layers.{i}."
        own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        layer.load_state_dict(own)
        layers.append(layer)
    tokens = torch.tensor(list(Path(eval_text).read_bytes()))
    width = config.seq_len
    count = (tokens.numel() - 1) // width
    windows = torch.stack([tokens[i * width : i * width + width + 1] for i in range(count)])
    with torch.no_grad():
        out = windows[:, :-1]
        for layer in layers:
            out = layer(out)
    return float(F.cross_entropy(out.reshape(-1, out.shape[-1]), windows[:, 1:].reshape(-1)))


def fine_tune_defaults_run(rank: int, world: int, directory: str, folder: str) -> dict:
    """``--model-dir`` with the default lr, schedule and warm-up (float64): the metrics, and on
    rank 0 the held-out loss of the exported folder as ``transformers`` computes it."""
    from pipetrain.app.metrics import read_metrics
    from pipetrain.app.train import train

    root = Path(directory)
    train_text, eval_text = _texts(root, rank)
    args = [
        "--model-dir",
        folder,
        "--dtype",
        "float64",
        "--seq-len",
        "24",
        "-m",
        "2",
        "--microbatch-size",
        "2",
        "--steps",
        "6",
        "--data",
        train_text,
        "--eval-data",
        eval_text,
        "--eval-every",
        "2",
        "--metrics",
        f"{directory}/m.jsonl",
        "--export",
        f"{directory}/export",
        "--svg",
        f"{directory}/step.svg",
        "--timeout",
        "60",
    ]
    run = train(train_args(*args), torch.device("cpu"))
    if rank != 0:
        return {}
    return {
        "losses": run.losses,
        "metrics": read_metrics(f"{directory}/m.jsonl"),
        "reference_eval": _folder_eval_loss(train_args(*args), f"{directory}/export"),
    }


def _folder_eval_loss(config, exported: str) -> float:
    """The held-out documents' token-mean loss under ``transformers``' model from ``exported``,
    each document run alone (no packing: what the packed rows' masks must reproduce)."""
    from transformers import AutoModelForCausalLM

    from pipetrain.app.batch_source import folder_corpus

    corpus = folder_corpus(config, config.eval_data)
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float64).eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len(corpus)):
            ids = torch.as_tensor(corpus.document(i)[0].astype("int64"))[None]
            logits = model(ids, use_cache=False).logits[0, :-1]
            total += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
            count += ids.shape[1] - 1
    return total / count
