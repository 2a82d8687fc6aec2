"""``pipetrain train --model-dir DIR``: fine-tune a local Hugging Face model folder.

The folder (``config.json``, safetensors files, a tokenizer) gives the model; the flags give the
run. Each worker builds only its own stages with ``pipetrain.hf.from_pretrained`` (a lazy stage
sequence: only this rank's tensors are read), tensor-parallelized by the Llama family's plan with
``--tp`` and recomputing as a plan's ``recompute`` says.

Mixture-of-experts folders (Qwen2-MoE, Qwen3-MoE, Mixtral, GPT-OSS) train with their router's
load-balancing loss by default, ``router_aux_loss_coef`` × each MoE layer's balancing loss per
micro-batch (``pipetrain.hf.router_losses``), as Megatron-Core's and torchtitan's MoE training
always balances; ``--router-aux-loss off`` trains without it. What a family cannot run (``--tp``
without its plan, packed documents its ``forward`` would let attend to each other, a kernel its
class lacks) and the folders ``pipetrain.hf`` refuses (a DeepSeek-V3 folder holding
multi-token-prediction weights) are refused before any process starts, each with the family's
reason (``pipetrain.hf.families``). DeepSeek-V3 balances its experts by a per-expert bias moved
after each optimizer step (``--expert-bias-rate``, ``pipetrain.hf.expert_bias``), not by a loss.

Data: ``--data`` (default the generated corpus) is read as documents — a text file's lines or
paragraphs, JSONL records of ``text`` or chat ``messages`` (the loss on the assistant's tokens
only), a local ``datasets`` folder — tokenized once by the folder's own tokenizer into the data
cache, and packed into rows of ``--seq-len`` with each document's boundaries kept (position ids
from 0 per document, no token attending across documents, no target crossing one); ``--packing
none`` right-pads one document per row under an ``attention_mask`` instead (``app.data``,
``app.batch_source``). The loss is ``causal_lm_token_loss`` under the pipeline's ``token_mean``,
a mean over the predicted tokens of the whole batch (all micro-batches and data-parallel
replicas), as ``transformers`` computes it with ``labels`` of -100 where nothing is predicted.
The attention implementation follows a fixed rule (``attention_implementation``).

A folder without tokenizer files is refused rather than fed bytes as token ids: a released model's
ids are its tokenizer's, and bytes would train it on a different language without an error.

``--export OUT`` writes the trained model with ``pipetrain.hf.save_pretrained`` at the end (every
process takes part; the tokenizer's files are saved beside it), a folder that ``transformers``
and ``--model-dir`` load, with a ``SHA256SUMS``; it is written beside ``OUT`` and renamed into
place when complete, so a failed export leaves nothing that looks like a model, and the run
holds ``OUT``'s lock meanwhile (a second run exporting there is refused). The checks here run before any process starts (``app.config``), so a
bad folder, flag or export folder is one line and exit 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipetrain.app.catalog import BYTE_VOCAB, FOLDER_MODELS, ModelShape
from pipetrain.app.checkpoints import make_writable_folder
from pipetrain.app.config import flags_given
from pipetrain.app.folder_lock import FolderLock, check_free, hold_on_rank0, sibling_lock_file

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pipetrain.app.config import TrainConfig
    from pipetrain.planner.layout import Layout

#: the fields of the built-in model's flags; the folder's config gives the model instead
BUILT_IN_MODEL_FIELDS = (
    "model",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "vocab",
    "tie_embeddings",
)
#: files that hold a tokenizer (``transformers``' fast or slow formats)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def run_shape(config: TrainConfig) -> ModelShape:
    """The model the run trains: the folder's (``--model-dir``) or the built-in model flags',
    checked."""
    if config.model_dir is not None:
        return folder_shape(config, folder_config(config))
    shape = config.shape
    shape.check()
    if config.model != "gpt":
        from pipetrain.hf.causal_lm import transformers_problem

        problem = transformers_problem()
        if problem is not None:
            raise ValueError(
                f"--model {config.model}: {problem} (or train the built-in model: --model gpt)"
            )
    if flags_given(config, ("router_aux_loss",)):
        raise ValueError(
            f"--router-aux-loss {config.router_aux_loss}: the built-in --model {config.model} "
            "has no router; it is for a mixture-of-experts --model-dir folder: drop it"
        )
    if config.vocab < BYTE_VOCAB:
        raise ValueError(f"--vocab {config.vocab}: the tokens are bytes, so it must be >= 256")
    return shape


def folder_config(config: TrainConfig) -> Any:
    """The ``transformers`` config of ``--model-dir``, checked: a folder with ``config.json`` and
    safetensors files, of a model type ``pipetrain.hf`` supports; ``ValueError`` otherwise."""
    flag = f"--model-dir {config.model_dir}"
    folder = Path(str(config.model_dir))
    if not folder.is_dir():
        raise ValueError(f"{flag}: no such folder (a local Hugging Face model folder)")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{flag} has no config.json: is it a Hugging Face model folder?")
    if not any(folder.glob("*.safetensors")):
        found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        held = f" (it has {', '.join(found)})" if found else ""
        raise ValueError(
            f"{flag} has no safetensors files{held}; pipetrain reads safetensors only "
            "(transformers' save_pretrained writes them)"
        )
    given = flags_given(config, BUILT_IN_MODEL_FIELDS)
    if given:
        raise ValueError(
            f"{flag} gives the model (its config.json): drop {', '.join(given)}, the built-in "
            "model's flags"
        )
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ValueError(f"{flag} needs transformers ({e}): pip install 'pipetrain[hf]'") from None
    try:
        hf_config = AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"{flag}: config.json cannot be read ({e})") from None
    from pipetrain.hf.families import REFUSED

    if hf_config.model_type in REFUSED:
        raise ValueError(
            f"{flag} holds a {hf_config.model_type!r} model; not supported yet: "
            f"{REFUSED[hf_config.model_type]}"
        )
    if hf_config.model_type not in FOLDER_MODELS:
        raise ValueError(
            f"{flag} holds a {hf_config.model_type!r} model; supported model types: "
            f"{', '.join(FOLDER_MODELS)}"
        )
    from pipetrain.hf.pretrained import check_folder

    try:
        check_folder(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: {e}") from None
    limit = getattr(hf_config, "max_position_embeddings", None)
    if limit is not None and config.seq_len > limit:
        raise ValueError(
            f"--seq-len {config.seq_len} is longer than the model's max_position_embeddings "
            f"{limit} ({flag}/config.json): give --seq-len <= {limit}"
        )
    return hf_config


def check_family_flags(config: TrainConfig, model_type: str) -> None:
    """The ``train`` flags the folder's family (``model_type``, checked by ``folder_config``)
    cannot run, refused with the family's reason (its row in ``pipetrain.hf.families``): ``--tp``
    without a tensor-parallel plan, packed documents where its ``forward`` cannot keep them apart,
    ``--router-aux-loss`` where it has no router, an ``--attention`` kernel its ``transformers``
    class does not have."""
    from pipetrain.hf.families import FAMILIES

    family = FAMILIES[model_type]
    held = f"--model-dir {config.model_dir} holds a {family.model_type!r} model"
    if config.tp > 1 and family.tensor_parallel is None:
        raise ValueError(f"--tp {config.tp}: {held}: {family.tensor_parallel_refusal}")
    if config.packing == "documents" and not family.packing:
        raise ValueError(
            f"--packing documents: {held}, whose forward builds its attention mask without the "
            "position ids, so packed documents would attend to each other: give --packing none "
            "(one document a row, padded)"
        )
    if config.attention != "auto":
        cls = causal_lm_class(model_type)
        kernel, flag = ATTENTION[config.attention]
        if not getattr(cls, flag, False):
            raise ValueError(
                f"--attention {config.attention}: {held}; transformers' {cls.__name__} has no "
                f"{kernel} attention: give --attention auto (it picks one the model has)"
            )
    if not family.is_moe and flags_given(config, ("router_aux_loss",)):
        raise ValueError(
            f"--router-aux-loss {config.router_aux_loss}: {held}, which has no router; drop it"
        )


def router_aux_loss_coef(config: TrainConfig, hf_config: Any) -> float | None:
    """The coefficient of the router's load-balancing loss the run trains with, ``None`` where
    it trains without one: a mixture-of-experts folder trains with its config's
    ``router_aux_loss_coef`` (``--router-aux-loss auto``, as Megatron-Core and torchtitan always
    balance their MoE training) unless that is 0 or ``--router-aux-loss off``. Released configs
    say ``output_router_logits: false`` (a setting for inference); it is not read here."""
    from pipetrain.hf.families import FAMILIES

    family = FAMILIES.get(hf_config.model_type)
    coefficient = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    if family is None or not family.is_moe or config.router_aux_loss == "off" or not coefficient:
        return None
    return coefficient


def router_line(config: TrainConfig) -> str | None:
    """What the launcher says of the router loss of a mixture-of-experts folder (``None`` for
    a dense one)."""
    if config.model_dir is None:
        return None
    from transformers import AutoConfig

    from pipetrain.hf.families import FAMILIES

    hf_config = AutoConfig.from_pretrained(Path(config.model_dir))
    family = FAMILIES.get(hf_config.model_type)
    if family is None or not family.is_moe:
        return None
    coefficient = router_aux_loss_coef(config, hf_config)
    if coefficient is not None:
        return (
            f"router loss on: router_aux_loss_coef {coefficient:g} × each MoE layer's "
            "load-balancing loss per micro-batch, reported as aux_loss/router_aux_loss "
            "(--router-aux-loss off trains without it)"
        )
    if config.router_aux_loss == "off":
        return "router loss off (--router-aux-loss off): no loss balances the experts' load"
    return "router loss off: the folder's config.json has no router_aux_loss_coef other than 0"


def folder_shape(config: TrainConfig, hf_config: Any) -> ModelShape:
    """The model of the folder as the checkpoints record it (resumed only by the same shape)."""
    heads = hf_config.num_attention_heads
    return ModelShape(
        model=hf_config.model_type,
        blocks=hf_config.num_hidden_layers,
        hidden=hf_config.hidden_size,
        heads=heads,
        kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        vocab=hf_config.vocab_size,
        seq_len=config.seq_len,
        dtype=config.dtype,
        seed=config.seed,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
    )


#: ``--attention``'s kernels as ``transformers`` names them, and the class flag that says a model
#: class has the kernel
ATTENTION = {"flex": ("flex_attention", "_supports_flex_attn"), "sdpa": ("sdpa", "_supports_sdpa")}


def causal_lm_class(model_type: str) -> Any:
    """The ``transformers`` causal-LM class of ``model_type`` (what ``AutoModelForCausalLM``
    builds), read from its mapping without building anything."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    return MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[model_type]]


def attention_implementation(
    config: TrainConfig, device: torch.device, model_class: Any = None
) -> str:
    """``transformers``' attention implementation for ``--attention``, by a fixed rule rather
    than by timing, so two identical runs compute the same thing: FlexAttention (a block mask
    that skips the blocks across packed documents) on CUDA, SDPA with the block-diagonal mask
    elsewhere. Under ``auto``, a ``model_class`` without that kernel takes the next of flex,
    SDPA, eager that it has (GPT-OSS's attention sinks have no SDPA kernel: eager on the CPU;
    GPT-2 has no FlexAttention: SDPA on CUDA); a kernel named by the flag is checked at launch
    (``check_family_flags``)."""
    choice = config.attention
    if choice != "auto":
        return ATTENTION[choice][0]
    for name in ("flex", "sdpa") if device.type == "cuda" else ("sdpa",):
        kernel, flag = ATTENTION[name]
        if model_class is None or getattr(model_class, flag, False):
            return kernel
    return "eager"


def check_export(config: TrainConfig) -> None:
    """``--export OUT``: needs ``--model-dir``; a writable folder (made if missing), empty unless
    ``--overwrite-export``, and not the model folder itself."""
    if config.export is None:
        if config.overwrite_export:
            raise ValueError("--overwrite-export needs --export DIR")
        return
    flag = f"--export {config.export}"
    if config.model_dir is None:
        raise ValueError(f"{flag} writes a Hugging Face folder: it needs --model-dir DIR")
    out = Path(config.export)
    if out.resolve() == Path(config.model_dir).resolve():
        raise ValueError(f"{flag} is the --model-dir folder: export to another folder")
    make_writable_folder(out, flag)
    check_free(sibling_lock_file(out), flag)
    if any(out.iterdir()) and not config.overwrite_export:
        raise ValueError(
            f"{flag} is not empty; name an empty or new folder, or replace what it holds with "
            "--overwrite-export"
        )


def _tokenizer(config: TrainConfig) -> Any:
    folder = Path(str(config.model_dir))
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"--model-dir {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): "
            "copy the model's tokenizer files into it; its token ids are the tokenizer's, so "
            "pipetrain does not feed it bytes instead"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"--model-dir {folder}: its tokenizer cannot be loaded ({e})") from None


def folder_stages(
    config: TrainConfig, layout: Layout, tp_mesh: Any, device: torch.device
) -> tuple[Any, bool]:
    """This worker's stages, a callable ``stage -> module`` that builds only the stage asked for
    (each carries the model's ties by global name), and whether the model ties any weights."""
    import torch
    from transformers import AutoConfig

    from pipetrain.app import kernels
    from pipetrain.hf import from_pretrained, parallelize_causal_lm
    from pipetrain.hf.families import FAMILIES
    from pipetrain.runtime.backward.activation_checkpoint import recompute_stage

    hf_config = AutoConfig.from_pretrained(Path(str(config.model_dir)))
    routed = FAMILIES[hf_config.model_type].is_moe
    stages = from_pretrained(
        str(config.model_dir),
        layout.stage_layers,
        dtype=getattr(torch, config.dtype),
        attn_implementation=attention_implementation(
            config, device, causal_lm_class(hf_config.model_type)
        ),
        # None for a dense family, which takes no router setting
        output_router_logits=router_aux_loss_coef(config, hf_config) is not None
        if routed
        else None,
        experts=config.experts,
    )
    recompute = layout.recompute if layout.recomputes else ("none",) * len(layout.stage_layers)

    if routed:  # the experts' kernel, said once per run (rank 0)
        from pipetrain.hf.experts_kernel import describe

        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            print(describe(config.experts, device, getattr(torch, config.dtype)), flush=True)

    def stage(index: int) -> nn.Module:
        module = stages[index]
        if tp_mesh is not None:
            parallelize_causal_lm(
                module,
                tp_mesh,
                sequence_parallel=config.sequence_parallel,
                vocab_parallel=not stages.tied,
            )
        # --float8 and --compile, each layer in place, before any recompute wrapper
        for name, (layer, _) in zip(module.layer_names, module.chain):
            kernels.prepare(layer, name == stages.names[-1], config, device)
        last = index == len(layout.stage_layers) - 1
        return recompute_stage(module, recompute[index], index, last=last)

    return stage, bool(stages.tied)


def export(config: TrainConfig, pipe: Any) -> None:
    """Write the trained model to ``--export`` (every process calls; see the module docstring):
    the folder locked for this run (``app.folder_lock``), written beside it and renamed into
    place whole (``pipetrain.hf.save_pretrained``), replacing what it held."""
    from pipetrain.hf import save_pretrained

    out = Path(str(config.export))
    lock = FolderLock(sibling_lock_file(out), f"--export {out}")
    hold_on_rank0(lock)
    try:
        save_pretrained(pipe, out, tokenizer=_tokenizer(config))
    finally:
        lock.release()
