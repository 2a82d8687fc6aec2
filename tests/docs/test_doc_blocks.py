"""Every python, sh and bash block of the README and docs/*.md runs in the test suite, or says on
the line above it why not (``<!-- not run: REASON -->``: GPUs, several machines, installs).

The command blocks run in one folder, in the documentation's order (a plan written by one block
is the one a later block trains with), each distinct command once, ``pipetrain`` in this
process (its workers are processes of their own); where a block reads a released model's folder
(Llama-3.2-1B) a tiny folder of that name stands in, and a training run is ``SHORTER`` times
shorter (its ``--steps``, default 60, and ``--checkpoint-every``) and ``pipetrain profile``
times each layer once, alone: the flags are the ones written, resuming from a checkpoint
included, on runs of seconds. No command's output carries the import notices of libraries a
user cannot act on (``NOT_OURS``). The python blocks run here or in
``test_readme_runs.py``, each after a prelude that makes what its text assumes
(``readme_cases``)."""

from __future__ import annotations

import contextlib
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from readme_cases import (
    CLOSE_WITH,
    FACTORY_SPLIT,
    FINE_TUNING,
    FROM_PLAN,
    LOGGING,
    PROFILER,
    ROOT,
    TENSOR_PARALLEL,
    block_code,
    commands,
    doc_blocks,
    run_four_rank_blocks,
    run_two_rank_blocks,
)
from runtime_harness import launch

PROFILE_BLOCK = (
    "docs/planning.md: costs = pipetrain.profile(layers, sample_microbatch, loss_fn=loss, "
    'target=targets, path="costs.json")'
)
#: python blocks run by tests/docs/test_readme_runs.py (the profile block also here, by name)
RUN_IN_README_TESTS = {
    PROFILE_BLOCK,
    'README.md: dist.init_process_group("nccl")',
    "README.md: layers = pipetrain.hf.causal_lm_layers(model)",
    'README.md: program = validate(lower(build_schedule("zbv", num_ranks=4, num_microbatches=8)))',
    'docs/training.md: layers = {"embed": Embed(), **{f"blocks.{i}": Block() for i in range(L)}, '
    '"head": Head()}',
}
#: python blocks run here
DROPOUT_KEYS = "docs/runtime.md: keys = DropoutKeys(seed=S).attach(layers)"
RUN_HERE = {
    FROM_PLAN,
    FACTORY_SPLIT,
    TENSOR_PARALLEL,
    CLOSE_WITH,
    PROFILER,
    LOGGING,
    FINE_TUNING,
    DROPOUT_KEYS,
}


def test_every_block_runs_or_says_why_not() -> None:
    blocks = doc_blocks()
    keys = [b.key for b in blocks]
    assert len(set(keys)) == len(keys), "two blocks share a first line: name them apart"
    for block in blocks:
        where = f"{block.doc}:{block.line}"
        if block.not_run is not None:
            assert len(block.not_run.split()) >= 2, f"{where}: say why it is not run"
        elif block.language == "python":
            assert block.key in RUN_IN_README_TESTS | RUN_HERE, f"{where}: no test runs it"
    runnable = {b.key for b in blocks if b.not_run is None}
    assert RUN_IN_README_TESTS | RUN_HERE <= runnable, "a test runs a block that is gone"
    print("not run:", *(f"{b.doc}:{b.line}: {b.not_run}" for b in blocks if b.not_run), sep="\n")


def test_the_dropout_keys_block_draws_the_same_masks_whatever_the_global_stream() -> None:
    """docs/runtime.md's unsplit reference loop, as written, twice from different global random
    states: the same keys give the same losses (and a third run with another seed does not)."""
    import copy

    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.manual_seed(0)
    made = [nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)) for _ in range(2)]
    batches = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(3)]

    def losses(seed: int, stream: int) -> list[float]:
        layers = copy.deepcopy(made)
        model = nn.Sequential(*layers).train()
        scope = {"S": seed, "layers": layers, "model": model}
        scope |= {"micro_batches": batches, "loss_fn": F.mse_loss}
        torch.manual_seed(stream)  # the caller's own stream: the keys must not depend on it
        out = []
        code = block_code(DROPOUT_KEYS).replace("loss_j = ", "out.append(").rstrip()
        code = code.replace("model(x), y)", "model(x), y).item())")
        exec(compile(code, "docs/runtime.md: dropout keys", "exec"), scope | {"out": out})
        return out

    assert losses(7, 1) == losses(7, 2)
    assert losses(7, 1) != losses(8, 1)


def test_the_logging_block_runs() -> None:
    code = block_code(LOGGING) + "import logging\nlogging.getLogger('pipetrain.x').info('heard')\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "pipetrain.x heard" in done.stderr, done.stderr


@pytest.mark.slow
def test_the_two_rank_python_blocks_run(tmp_path: Path) -> None:
    results = launch(2, run_two_rank_blocks, str(tmp_path), timeout=180)
    for said in results:
        assert said["closed"] and said["profiled"] and said["exported"], said
        assert 0 < said["loss"] < 10 and 0 < said["fine_tuned"] < 10, said
    assert results[0]["fine_tuned"] == results[1]["fine_tuned"], results


@pytest.mark.slow
def test_the_four_rank_python_blocks_run(tmp_path: Path) -> None:
    results = launch(4, run_four_rank_blocks, str(tmp_path), timeout=240)
    for name in ("from_plan", "factory", "tensor_parallel"):
        losses = {r[name] for r in results}
        assert len(losses) == 1 and 0 < losses.pop() < 100, (name, results)


#: a chat template for the stand-in tokenizer (its characters are the corpus's)
CHAT_TEMPLATE = "{% for m in messages %}{{ m.role }} = {{ m.content }} {% endfor %}"


def _tiny_released_model(folder: Path) -> None:
    """A tiny Llama folder named Llama-3.2-1B (with a tokenizer that has a chat template, rows
    of 512 tokens), a text, and chat and held-out JSONL files of the text's lines."""
    from finetune_cases import tokenizer
    from readme_cases import _tiny_llama

    from pipetrain.app.models.data import make_corpus

    _tiny_llama(2, positions=512).save_pretrained(folder / "Llama-3.2-1B")
    tok = tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(folder / "Llama-3.2-1B")
    text = make_corpus()[:20_000]
    (folder / "data.txt").write_bytes(text)
    lines = text.decode().splitlines()[:-1]
    turns = [
        {"role": role, "content": line}
        for role, line in zip(("user", "assistant") * len(lines), lines)
    ]
    chats = [{"messages": turns[i : i + 2]} for i in range(0, len(turns) - 1, 2)]
    (folder / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    (folder / "eval.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines[:40]))


#: what torchao and torch print on import on a machine without torchao's CUDA kernels
NOT_OURS = ("Failed to load", "register_constant", "Detected no triton")
#: how many times shorter a documented training run is here
SHORTER = 20
_DEFAULT_STEPS = 60


def shortened(words: list[str]) -> list[str]:
    """A ``pipetrain train`` command ``SHORTER`` times shorter: its steps (at least 2) and
    checkpoint interval divided; ``pipetrain profile`` timing each layer once, alone; any
    other command as it is."""
    if words[:2] == ["pipetrain", "profile"]:
        return [*words, "--repeats", "1", "--context", "1"]
    if words[:2] != ["pipetrain", "train"]:
        return words
    out = list(words)
    steps = _DEFAULT_STEPS
    for flag, least in (("--steps", 2), ("--checkpoint-every", 1)):
        if flag in out:
            at = out.index(flag) + 1
            if flag == "--steps":
                steps = int(out[at])
            out[at] = str(max(least, int(out[at]) // SHORTER))
    if "--steps" not in out:
        out += ["--steps", str(max(2, steps // SHORTER))]
    return out


def test_a_shortened_run_keeps_its_flags_and_resumes_past_its_checkpoint() -> None:
    first = shortened("pipetrain train --checkpoint-every 20 --steps 40 -s zbv".split())
    assert first == "pipetrain train --checkpoint-every 1 --steps 2 -s zbv".split()
    assert shortened("pipetrain train --resume".split())[-2:] == ["--steps", "3"]
    assert shortened(["pipetrain", "plan", "--ranks", "2"]) == ["pipetrain", "plan", "--ranks", "2"]
    profile = ["pipetrain", "profile", "--repeats", "1", "--context", "1"]
    assert shortened(["pipetrain", "profile"]) == profile


def _run_command(line: str, folder: Path, capfd) -> str:
    """Run one documented command in ``folder`` (``> FILE`` redirects its output); its output."""
    from pipetrain.cli.commands import main

    words = shlex.split(line, comments=True)
    target = None
    if ">" in words:
        at = words.index(">")
        words, target = words[:at], words[at + 1]
    words = shortened(words)
    assert words[0] == "pipetrain", f"{line}: only pipetrain commands run here"
    with contextlib.ExitStack() as stack:
        if target is not None:
            out = stack.enter_context((folder / target).open("w"))
            stack.enter_context(contextlib.redirect_stdout(out))
        status = main(words[1:])
    said = capfd.readouterr()
    assert status == 0, f"{line}: exit {status}\n{said.out[-3000:]}\n{said.err[-3000:]}"
    return said.err


COMMAND_BLOCKS = [b for b in doc_blocks() if b.language != "python" and b.not_run is None]


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> dict:
    """What the command blocks share, in the documentation's order: the files one block wrote
    (a costs file, a plan) for the next, and the commands already run (each runs once)."""
    folder = tmp_path_factory.mktemp("shared")
    _tiny_released_model(folder)
    return {"folder": folder, "ran": set()}


@pytest.mark.slow
@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=lambda b: f"{b.doc}:{b.line}")
def test_the_command_blocks_run(block, shared: dict, tmp_path: Path, monkeypatch, capfd) -> None:
    """Each block in a folder of its own (one block's checkpoints are not another's), holding
    the files the blocks before it wrote."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    for path in shared["folder"].iterdir():
        (tmp_path / path.name).symlink_to(path)
    for line in commands(block):
        words = tuple(shlex.split(line, comments=True))
        if words in shared["ran"]:
            continue
        shared["ran"].add(words)
        errors = _run_command(line, tmp_path, capfd)
        assert "Traceback" not in errors, f"{block.doc}:{block.line}: {line}\n{errors}"
        for notice in NOT_OURS:  # library notices a user cannot act on stay out of the output
            assert notice not in errors, f"{block.doc}:{block.line}: {line}\n{errors}"
    for path in tmp_path.glob("*.json"):
        if not path.is_symlink():
            path.replace(shared["folder"] / path.name)


def test_the_planning_block_profiles_the_layers_by_name(tmp_path: Path, monkeypatch) -> None:
    """docs/planning.md's first block with ``layers`` as ``from_plan`` takes them below it (and
    ``pipetrain.hf.causal_lm_layers`` gives them): a mapping name → layer."""
    import torch
    from torch import nn

    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {
        "layers": {f"blocks.{i}": nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for i in range(4)},
        "sample_microbatch": torch.randn(4, 16),
        "loss": nn.functional.mse_loss,
        "targets": torch.randn(4, 16),
    }
    code = block_code(PROFILE_BLOCK)
    exec(compile(code, "docs/planning.md", "exec"), scope)
    assert sum(scope["plan"].stage_layers) == 4
    assert len(json.loads((tmp_path / "costs.json").read_text())["layers"]) == 4
