"""``from_pretrained``: a released model folder as pipeline stages, each rank reading only its own.

    stages = pipetrain.hf.from_pretrained("Llama-3.2-1B", [9, 9], dtype=torch.bfloat16)
    pipe = Pipeline(stages, "1f1b", 8, pipetrain.hf.causal_lm_loss)   # builds its stages only

The result is a lazy sequence of stages, like ``pipetrain.split``'s factory form: ``Pipeline``
asks only for this rank's. Building stage ``s``:

1. the whole model is built on the meta device from the folder's config (no memory, no
   initialisation) with ``transformers``' own ``from_config``, and cut into layers by
   ``causal_lm_layers``' rules;
2. only stage ``s``'s layers are materialised (``to_empty``) on ``device``;
3. each of their parameters and persistent buffers is read from the safetensors file that holds
   it — no other tensor is read — and copied in, cast to ``dtype`` (a tied head reads the
   embedding's tensor: files of tied models omit the copy);
4. the non-persistent buffers (RoPE's ``inv_freq``), in no file, are recomputed by the model's
   own ``_init_weights`` with the loaded tensors marked as initialised — what
   ``transformers``' ``from_pretrained`` does after loading on the meta device. They are first
   filled with NaN, and a buffer still holding one afterwards is refused: a buffer the model's
   init does not recompute cannot be known.

So every parameter and buffer equals ``AutoModelForCausalLM.from_pretrained(model_dir,
dtype=dtype)``'s. Host memory while loading stays within the rank's own layers (when ``device``
is the CPU) plus the largest tensor read, beside the meta-device model's Python objects: tensors
are read one at a time (``checkpoint_files``), largest first, into memory that becomes resident
only as it is written (``benchmarks/runtime/hf_load_memory.py`` measures it). A tensor the folder lacks is a
``KeyError`` naming it (``transformers`` would initialise it randomly, with a warning).

With ``recompute=``, the decoder layers chosen run inside non-reentrant activation checkpoints,
full or selective (``runtime.backward.activation_checkpoint.recompute_layers``), exact under every
schedule and either weight-gradient split like any checkpoint inside a stage (docs/training.md,
"Activation checkpointing").

Stages are returned in training mode (``transformers`` returns its model in eval mode). Each
carries the tie of embedding and head by global name (``Stage.tied_names``), so ``Pipeline``
sums the tied gradient as for ``split``'s stages, and the model's config (``Stage.hf_config``)
for ``pipetrain.hf.save_pretrained``, and the folder it came from (``Stage.hf_folder``), whose
config and tokenizer files a checkpoint keeps copies of (``app.checkpoints``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipetrain.hf.causal_lm import layers_of, require_transformers, tied_weights
from pipetrain.hf.checkpoint_files import ModelFiles, require_folder
from pipetrain.hf.experts_kernel import GROUPED_MM, LOOP, check_choice, use_experts
from pipetrain.hf.families import Family, family_of
from pipetrain.hf.stored_layout import FolderTensors
from pipetrain.runtime.backward.activation_checkpoint import RECOMPUTE_MODES, recompute_layers
from pipetrain.runtime.named_layers import Stage, check_counts, stage_ranges


def from_pretrained(
    model_dir: str | Path,
    stage_layers: Sequence[int],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
    recompute: str | Mapping[int, str] = "none",
    experts_implementation: str | None = None,
    output_router_logits: bool | None = None,
    experts: str = "auto",
) -> PretrainedStages:
    """The model in ``model_dir`` (``config.json`` and safetensors files) cut into stages of
    ``stage_layers`` consecutive layers each (embedding, decoder layers, final norm and head
    are layers: a model of ``L`` decoder layers has ``L + 3``).

    ``dtype``: the parameters' dtype; default what ``transformers`` picks (the config's
    ``dtype``, else the stored tensors'). ``device``: where each rank's layers are materialised
    and loaded (default the CPU; ``Pipeline`` moves them to its device — pass that device to
    load straight onto it). ``attn_implementation``: as in ``transformers`` (``"sdpa"``,
    ``"eager"``, ``"flex_attention"``...; default its choice). ``recompute``: activation
    checkpointing of decoder layers — one mode for every decoder layer (``"none"``,
    ``"selective"``, ``"full"``), or a mapping from a decoder layer's index (global, 0-based: the
    ``N`` of ``model.layers.N``, GPT-2's ``transformer.h.N``) to its mode, unnamed layers
    ``"none"``. Each chosen layer runs inside a non-reentrant checkpoint
    (``runtime.backward.activation_checkpoint.Recomputed``, held in the stage's call list only,
    so parameter names and state-dict keys are the model's); the embedding, the final norm and
    the head are never wrapped. ``experts``: which kernel a mixture-of-experts family's experts
    run on, ``"auto"`` (a grouped GEMM on CUDA bf16 with compute capability >= 9.0, the loop
    over experts elsewhere: ``experts_kernel``), ``"grouped"`` or ``"loop"``;
    ``experts_implementation``, ``transformers``' name for the same (``"grouped_mm"``,
    ``"eager"``), is taken too.
    ``output_router_logits``: overrides the config's, as ``transformers``' ``from_pretrained``
    takes it; ``True`` makes each MoE layer add its router's balancing loss
    (``router_losses``; released configs say ``False``). An ``ImportError`` where ``transformers`` is older than the wrappers need
    (``causal_lm.MIN_TRANSFORMERS``)."""
    require_transformers()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(require_folder(model_dir))
    family = family_of(config)  # a refused family's reason before any file is looked at
    refuse_quantized(config, model_dir)
    if output_router_logits is not None:
        if not family.is_moe:
            raise ValueError(
                f"output_router_logits is for mixture-of-experts models; {model_dir} holds a "
                f"dense {family.model_type} model: leave it out"
            )
        config.output_router_logits = output_router_logits
    files = ModelFiles.open(model_dir)
    return PretrainedStages(
        files,
        config,
        stage_layers,
        _dtype(dtype, config, files),
        device,
        attn_implementation,
        recompute=recompute,
        experts=_experts_choice(experts, experts_implementation),
    )


def _experts_choice(experts: str, experts_implementation: str | None) -> str:
    """``from_pretrained``'s experts kernel as ``experts_kernel``'s choice: ``experts``, or
    ``transformers``' name for it; a ``ValueError`` for any other kernel, or both given."""
    check_choice(experts)
    if experts_implementation is None:
        return experts
    named = {GROUPED_MM: "grouped", LOOP: "loop"}
    if experts_implementation not in named:
        raise ValueError(
            f"experts_implementation={experts_implementation!r}; pipetrain runs 'grouped_mm' "
            "or 'eager' (or give experts='auto', 'grouped' or 'loop')"
        )
    if experts != "auto":
        raise ValueError("give experts= or experts_implementation=, not both")
    return named[experts_implementation]


def _recompute_modes(recompute: object, decoder_names: Sequence[str]) -> dict[str, str]:
    """``from_pretrained``'s ``recompute`` as {decoder layer name: mode} for the layers that
    recompute; a ``ValueError`` names the legal values."""
    legal = ", ".join(map(repr, RECOMPUTE_MODES))
    count = len(decoder_names)
    if isinstance(recompute, str):
        if recompute not in RECOMPUTE_MODES:
            raise ValueError(f"recompute={recompute!r}; legal modes: {legal}")
        recompute = dict.fromkeys(range(count), recompute)
    if not isinstance(recompute, Mapping):
        raise ValueError(
            f"recompute={recompute!r}; give a mode ({legal}) or a mapping from decoder layer "
            "index to mode"
        )
    out = {}
    for index, mode in recompute.items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(
                f"recompute has the key {index!r}; its keys are decoder layer indices, integers "
                f"0 to {count - 1}"
            )
        if not 0 <= index < count:
            raise ValueError(
                f"recompute names decoder layer {index}, but the model has {count} (indices 0 "
                f"to {count - 1})"
            )
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"recompute mode {mode!r} for decoder layer {index}; legal: {legal}")
        if mode != "none":
            out[decoder_names[index]] = mode
    return out


def _dtype(dtype, config, files: ModelFiles) -> torch.dtype:
    """``transformers``' ``dtype="auto"``: the argument, else the config's, else the stored one."""
    if dtype is None:
        dtype = getattr(config, "dtype", None) or files.stored_dtype() or torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r}; give a floating torch.dtype such as torch.bfloat16")
    return dtype


def check_folder(model_dir: str | Path) -> None:
    """``model_dir``'s files are whole and hold every tensor its config describes, in the shape
    it describes (a launcher's check before any process loads anything, from the files' headers
    alone; ``from_pretrained`` makes the same check on every rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(require_folder(model_dir))
    family = family_of(config)  # a refused family's reason before any file is looked at
    refuse_quantized(config, model_dir)
    files = ModelFiles.open(model_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    prefix = getattr(skeleton, "base_model_prefix", "")
    check_tensors(family.folder_tensors(files, config, prefix), skeleton, tied_weights(skeleton))


def refuse_quantized(config: Any, model_dir: str | Path) -> None:
    """A ``ValueError`` for a folder of quantized weights (``quantization_config``: GPT-OSS's
    MXFP4 release, for one): ``pipetrain.hf`` reads tensors under the model's names and trains
    them as they are, so it takes unquantized folders only."""
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (
            quantization.get("quant_method", "?")
            if isinstance(quantization, dict)
            else getattr(quantization, "quant_method", "?")
        )
        raise ValueError(
            f"{model_dir} holds quantized weights ({method}); pipetrain.hf trains unquantized "
            "folders: dequantize first (load it with transformers' dequantize=True and "
            "save_pretrained, or use a bf16 release)"
        )


def check_tensors(tensors: FolderTensors, skeleton: Any, tied) -> None:
    """Every tensor of ``skeleton``'s state dict is in the folder (whole, or as its experts'
    stored tensors), of the skeleton's shape (the headers only, no tensor read): a
    ``ValueError`` naming the missing ones or the first of another shape, on every rank alike,
    rather than a ``KeyError`` mid-load on the ranks whose stages hold them."""
    files = tensors.files
    sources = {target: source for source, target in tied}
    state = skeleton.state_dict(keep_vars=True)
    missing = []
    for name, tensor in state.items():
        try:
            keys = tensors.keys(name, sources.get(name))
        except KeyError:
            missing.append(name)
            continue
        stored, whole = tensors.shape(keys), len(keys) == 1 and len(keys[0]) == 1
        if stored != tuple(tensor.shape) and (stored is not None or not whole):
            key = keys[0][0]
            what = "" if whole else f" (one of the experts' tensors of {name!r})"
            raise ValueError(
                f"{files.folder / files.where[key]} holds {key!r} of shape "
                f"{tuple(files.shapes[key])}{what}, but config.json describes "
                f"{tuple(tensor.shape)}; is config.json this model's?"
            )
    if missing:
        shown = ", ".join(repr(n) for n in missing[:4]) + (" ..." if len(missing) > 4 else "")
        raise ValueError(
            f"{files.folder} holds no tensor for {len(missing)} of the {len(state)} its "
            f"config.json describes ({shown}); is it a complete checkpoint of this model? "
            "pipetrain.hf loads tensors under the model's own names"
        )


class PretrainedStages(Sequence):
    """The stages of a model folder, each built, materialised and loaded when first asked for
    (see the module docstring); asking again builds it again."""

    def __init__(
        self,
        files: ModelFiles,
        config: Any,
        stage_layers: Sequence[int],
        dtype: torch.dtype,
        device: torch.device | str | None,
        attn_implementation: str | None,
        *,
        recompute: str | Mapping[int, str] = "none",
        experts: str = "auto",
    ) -> None:
        self.files, self.dtype = files, dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._config, self._attn = config, attn_implementation
        #: the model's row of ``pipetrain.hf.families`` (a refused family stops here)
        self.family: Family = family_of(config)
        #: the experts' kernel of every MoE layer built (``experts_kernel``), applied per call
        self.experts = check_choice(experts)
        skeleton = self._skeleton()
        layers = layers_of(skeleton)
        #: the global layer names, in call order
        self.names = list(layers)
        self.counts = check_counts(stage_layers, len(self.names))
        self.ranges = stage_ranges(self.counts)
        #: (source, target) parameter names the model ties (the target is the source)
        self.tied = tied_weights(skeleton)
        self.prefix: str = getattr(skeleton, "base_model_prefix", "")
        #: the model's config as loaded (its dtype and attention implementation set)
        self.config = skeleton.config
        #: the decoder layers' global names, by index (what ``recompute`` may wrap)
        self.decoder_names = [
            n for n, layer in layers.items() if isinstance(layer, self.family.decoder)
        ]
        #: {decoder layer name: mode} for the layers that recompute (``from_pretrained``)
        self.recompute = _recompute_modes(recompute, self.decoder_names)
        #: the folder's tensors under the model's names (experts fused as they are read)
        self.tensors = self.family.folder_tensors(files, config, self.prefix)
        check_tensors(self.tensors, skeleton, self.tied)

    def _skeleton(self) -> Any:
        """The whole model on the meta device (parameters and buffers without storage)."""
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": self.dtype}
        if self._attn is not None:
            kwargs["attn_implementation"] = self._attn
        if self.family.is_moe:  # the layers pick per call; the config starts at the loop
            kwargs["experts_implementation"] = LOOP
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(copy.deepcopy(self._config), **kwargs)

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, stage):  # type: ignore[override]
        if isinstance(stage, slice):
            return [self[s] for s in range(len(self))[stage]]
        if not -len(self) <= stage < len(self):
            raise IndexError(f"stage {stage} out of range: there are {len(self)} stages")
        skeleton = self._skeleton()
        layers = layers_of(skeleton)
        named = [(self.names[i], layers[self.names[i]]) for i in self.ranges[stage]]
        for _, layer in named:
            layer.to_empty(device=self.device)
        module = Stage(named)
        use_experts(module, self.experts)
        self._retie(module)
        loaded = self._load(module)
        recompute_buffers(module, skeleton, loaded, self.family.buffers)
        module.tied_names = [tuple(sorted(pair)) for pair in self.tied]
        module.hf_config = self.config
        module.hf_folder = (
            self.files.folder
        )  # its config and tokenizer files travel with checkpoints
        modes = {n: m for n, m in self.recompute.items() if n in module.layer_names}
        if modes:
            recompute_layers(module, modes, stage)
        return module.train()

    def _retie(self, module: Stage) -> None:
        """Where both ends of a tie are in this stage, make them one parameter again
        (materialising gave each its own)."""
        held = dict(module.named_parameters(remove_duplicate=False))
        for source, target in self.tied:
            if source in held and target in held:
                owner, _, attr = target.rpartition(".")
                module.get_submodule(owner).register_parameter(attr, held[source])

    @torch.no_grad()
    def _load(self, module: Stage) -> list[torch.Tensor]:
        """Copy every parameter and persistent buffer of ``module`` from the files; returns
        them (each tensor once)."""
        sources = {target: source for source, target in self.tied}
        loaded: list[torch.Tensor] = []
        seen: set[int] = set()
        state = module.state_dict(keep_vars=True).items()
        # Largest first: materialised memory is resident only once written, so while the
        # largest tensor is read (a copy of it held, beside the part of the stage written so
        # far) the rest of the stage is not yet resident.
        for name, tensor in sorted(state, key=lambda item: -item[1].numel()):
            if id(tensor) in seen:
                continue
            value = self.tensors.read(self.tensors.keys(name, sources.get(name)))
            if value.shape != tensor.shape:
                raise ValueError(
                    f"{name!r} has shape {tuple(value.shape)} in {self.files.folder} but "
                    f"{tuple(tensor.shape)} in the model its config describes"
                )
            tensor.copy_(value)
            del value
            seen.add(id(tensor))
            loaded.append(tensor)
        return loaded


def recompute_buffers(
    module: nn.Module, skeleton: Any, loaded: list[torch.Tensor], expected: Sequence[str]
) -> None:
    """Fill ``module``'s non-persistent buffers the way ``transformers`` does after loading:
    the model's ``_init_weights`` on each module that owns one, with ``loaded`` marked as
    initialised so that only what was not loaded is written (see the module docstring). A buffer
    not in ``expected`` (the family row's ``buffers``) is refused: its family does not say the
    model's init recomputes it."""
    from transformers import initialization

    owners: dict[nn.Module, list[str]] = {}
    for sub in module.modules():
        names = [n for n in sub._non_persistent_buffers_set if sub._buffers.get(n) is not None]
        unknown = [n for n in names if n not in expected]
        if unknown:
            raise ValueError(
                f"{type(sub).__name__}.{unknown[0]} is a non-persistent buffer (in no "
                "checkpoint) that this model family's row in pipetrain.hf.families does not "
                "list; add it to the row's buffers once the model's _init_weights is known to "
                "recompute it"
            )
        if names:
            owners[sub] = names
    if not owners:
        return
    with torch.no_grad():
        for sub, names in owners.items():
            for name in names:
                buffer = sub._buffers[name]
                if buffer is None or not buffer.is_floating_point():
                    raise ValueError(
                        f"{type(sub).__name__}.{name} is a non-floating non-persistent buffer; "
                        "pipetrain.hf cannot check that the model's init recomputes it"
                    )
                buffer.fill_(math.nan)
    for tensor in loaded:
        tensor._is_hf_initialized = True  # type: ignore[attr-defined]
    try:
        with torch.no_grad(), initialization.guard_torch_init_functions():
            for sub in owners:
                skeleton._init_weights(sub)
    finally:
        for tensor in loaded:
            del tensor._is_hf_initialized  # type: ignore[attr-defined]
    for sub, names in owners.items():
        for name in names:
            if torch.isnan(sub._buffers[name]).any():  # type: ignore[arg-type]
                raise ValueError(
                    f"the non-persistent buffer {type(sub).__name__}.{name} is in no checkpoint "
                    "and the model's _init_weights does not recompute it; pipetrain.hf cannot "
                    "load this model per rank"
                )
