"""``pipetrain.hf.from_pretrained`` and ``save_pretrained``: every parameter and buffer equal to
``transformers``' loading, only a rank's own tensors read, float64 loss and gradients equal to
the unsplit model on every runnable schedule at 2 ranks (Llama in one file, GPT-2 tied in
shards), export that ``transformers`` loads (data parallel too), DCP checkpoints, the naive
meta-device route refused, and the peak host memory while loading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch
from hf_cases import build
from hf_pretrained_cases import (
    BLOCKS,
    run_data_parallel_export,
    run_export,
    run_schedules,
    write_folders,
)
from runtime_harness import launch

import pipetrain
from pipetrain.hf import causal_lm_layers, from_pretrained

ROOT = Path(__file__).resolve().parents[2]
KINDS = ["llama", "qwen3", "qwen2-sliding", "mistral", "gpt2", "gpt2-tied"]


def _hf(folder, dtype=torch.float64):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_every_parameter_and_buffer_is_what_transformers_loads(tmp_path, kind, sharded):
    """Stages of 2, 1 and 2 layers: their tensors (non-persistent buffers included, by the name
    the model gives the same module) and their chained logits equal the loaded model's."""
    build(kind, BLOCKS).save_pretrained(tmp_path, **({"max_shard_size": "4KB"} if sharded else {}))
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    model = _hf(tmp_path)
    stages = [from_pretrained(tmp_path, [2, 1, 2])[s] for s in range(3)]
    ours: dict[int, torch.Tensor] = {}
    for stage in stages:
        for module in stage.modules():
            for name, tensor in (*module._parameters.items(), *module._buffers.items()):
                ours[id(getattr(_same_module(model, stage, module), name))] = tensor
    theirs = {id(t): (n, t) for n, t in (*model.named_parameters(), *model.named_buffers())}
    assert set(theirs) <= set(ours)
    for key, (name, tensor) in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), name
    ids = torch.randint(0, 61, (3, 8), generator=torch.Generator().manual_seed(1))
    h = ids
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(ids).logits)
    assert all(stage.training for stage in stages)
    if kind == "gpt2-tied":
        assert stages[0].tied_names == [("lm_head.weight", "transformer.wte.weight")]


def _same_module(model, stage, module):
    """The loaded model's module at the path ``module`` has in ``stage`` (a rotary table shared
    by the decoder layers is the model's ``rotary_emb``)."""
    path = next(n for n, m in stage.named_modules() if m is module)
    if path.endswith("rotary_emb"):
        path = path.split(".layers.")[0] + ".rotary_emb"
    return model.get_submodule(path)


def test_one_stage_reads_only_its_tensors_and_ties_within_a_stage(tmp_path, monkeypatch):
    from pipetrain.hf.checkpoint_files import ModelFiles

    build("gpt2-tied", BLOCKS).save_pretrained(tmp_path, max_shard_size="4KB")
    read: list[str] = []
    original = ModelFiles.read
    monkeypatch.setattr(
        ModelFiles, "read", lambda self, key: read.append(key) or original(self, key)
    )
    stages = from_pretrained(tmp_path, [1, 3, 1])
    assert len(stages) == 3 and read == []
    middle = stages[1]
    assert sorted(read) == sorted(middle.state_dict())  # the blocks and ln_f, nothing else
    read.clear()
    head = stages[2]
    assert read == ["transformer.wte.weight"]  # the file has no lm_head: the tie's source
    (whole,) = from_pretrained(tmp_path, [BLOCKS + 3])
    assert whole.get_parameter("lm_head.weight") is whole.get_parameter("transformer.wte.weight")
    assert torch.equal(head.get_parameter("lm_head.weight"), _hf(tmp_path).lm_head.weight)


def test_dtype_follows_transformers_and_bare_model_keys_load(tmp_path):
    from safetensors.torch import load_file, save_file

    build("gpt2", BLOCKS).save_pretrained(tmp_path)
    (stage,) = from_pretrained(tmp_path, [BLOCKS + 3])
    assert stage.get_parameter("lm_head.weight").dtype == torch.float64  # the config's dtype
    (single,) = from_pretrained(tmp_path, [BLOCKS + 3], dtype=torch.float32)
    ref = _hf(tmp_path, torch.float32).state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in single.state_dict().items())
    # released GPT-2 files name the bare model's tensors: h.0.attn..., wte.weight
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    save_file(
        {n.removeprefix("transformer."): t for n, t in tensors.items()},
        file,
        metadata={"format": "pt"},
    )
    (bare,) = from_pretrained(tmp_path, [BLOCKS + 3])
    assert all(torch.equal(t, stage.state_dict()[n]) for n, t in bare.state_dict().items())


def test_missing_tensors_other_formats_and_the_naive_meta_route_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    model = build("llama", BLOCKS)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="stage_layers=.*sums to 4 but the model has 5"):
        from_pretrained(tmp_path, [2, 2])
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file, metadata={"format": "pt"})
    # refused on every rank at once, also where this rank's stages hold no missing tensor
    with pytest.raises(ValueError, match="no tensor for 1 of .*'model.layers.1.mlp.up_proj"):
        from_pretrained(tmp_path, [2, 3])
    file.unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"safetensors files only.*|pytorch_model\.bin"):
        from_pretrained(tmp_path, [5])
    # built on the meta device, to_empty and load_state_dict would leave inv_freq unset
    with torch.device("meta"):
        meta = LlamaForCausalLM(model.config)
    with pytest.raises(ValueError, match="meta device.*inv_freq.*from_pretrained"):
        causal_lm_layers(meta)
    with pytest.raises(ValueError, match="meta device"):  # split's factory form builds on meta
        pipetrain.split(
            lambda i: list(causal_lm_layers(LlamaForCausalLM(model.config)).values())[i],
            [5],
            num_layers=5,
            init=lambda i, layer: None,
        )[0]


GROUPS = [
    ["gpipe", "1f1b", "zb-h1", "zb-h2"],
    ["interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv"],
    ["dualpipev", "v-half", "v-min"],
]


def test_the_groups_cover_every_runnable_schedule():
    from pipetrain.schedule.registry import FAMILIES

    assert sorted(n for g in GROUPS for n in g) == sorted(
        str(n) for n in FAMILIES if n != "dualpipe"
    )


@pytest.mark.slow
@pytest.mark.parametrize("names", GROUPS, ids=lambda g: g[0])
def test_loaded_stages_match_the_unsplit_model_on_every_schedule(tmp_path, names):
    folders = write_folders(tmp_path)
    failures = launch(2, run_schedules, folders, names, timeout=300)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_save_pretrained_writes_the_trained_weights_and_dcp_still_works(tmp_path):
    folders = write_folders(tmp_path)
    failures = launch(2, run_export, folders, str(tmp_path / "out"), timeout=300)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)
    index = json.loads((tmp_path / "out/gpt2-tied-1f1b/model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}
    assert "lm_head.weight" not in index["weight_map"]  # tied: the embedding is written
    # zbv: rank 0 holds embedding, block 0 and the head; rank 1 holds block 1 and the norm
    index = json.loads((tmp_path / "out/llama-zbv/model.safetensors.index.json").read_text())
    assert index["weight_map"]["lm_head.weight"] == "model-00001-of-00002.safetensors"


@pytest.mark.slow
def test_save_pretrained_under_fsdp_and_ddp(tmp_path):
    folders = write_folders(tmp_path)
    failures = launch(4, run_data_parallel_export, folders["llama"], str(tmp_path), timeout=300)
    problems = [f for rank_failures in failures for f in rank_failures]
    assert not problems, "\n".join(problems)


@pytest.mark.slow
def test_peak_host_memory_while_loading_stays_within_own_layers_and_the_largest_tensor():
    """Each stage loaded in a fresh process (benchmarks/runtime/hf_load_memory.py): the growth of the
    peak resident set is at most the stage's bytes plus its largest tensor."""
    script = ROOT / "benchmarks" / "runtime" / "hf_load_memory.py"
    args = ["--hidden", "512", "--vocab", "8000", "--layers", "4", "--shard-mb", "20"]
    done = subprocess.run(
        [sys.executable, str(script), *args, "--json", "/dev/stdout"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    rows = json.loads(done.stdout[done.stdout.index("[") :])
    assert len(rows) == 2
    for row in rows:
        assert 0 < row["peak_growth_bytes"] <= row["own_bytes"] + row["largest_bytes"], row
