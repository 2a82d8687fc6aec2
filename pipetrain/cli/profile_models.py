"""The models ``pipetrain profile`` measures: the one the model flags build (``app.catalog``) or a
Hugging Face folder's own layers (``--model-dir``), each as a chain of layers with its loss, its
batch and its tensor-parallel plan.

``parallelized`` is what each worker of a measured tensor-parallel degree
(``runtime.profile.profile_tp_measured``) runs: the same layers as the degree-1 profile (same
seed, same weights, same batch) put on its device and split by ``pipetrain.hf
.parallelize_causal_lm``, the function ``train --tp`` splits them with, so what is measured is
what trains. ``tp_refusal`` says why a model's layers cannot be split at a degree (the checks
``train --tp`` makes), so such a degree is derived or refused before any worker starts.
torch is imported inside the functions: the command's parser imports none.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from pipetrain.cli.flags import model_options, model_shape


class BuiltModel:
    """The model the model flags describe (``app.catalog``), built at each length asked."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.shape = model_shape(args)
        self.label = args.model
        self.names: list[str] | None = None
        self.tied = False

    def at(self, seq_len: int) -> tuple[list[Any], Any, Any, int, dict[str, Any]]:
        from pipetrain.app.catalog import build

        shape = dataclasses.replace(self.shape, seq_len=seq_len)
        model = build(shape)
        self.names = model.names
        self.tied = bool(model.tied)
        meta = {"model": shape.model, "shape": dataclasses.asdict(shape)}
        return model.layer_list(), model.loss_fn, model.batch, shape.vocab, meta

    def tp_refusal(self, degree: int) -> str | None:
        """Why ``train --tp degree`` refuses this model (``app.train_checks``); ``None``: it
        runs."""
        shape = self.shape
        if shape.model == "gpt":
            return f"--model {shape.model} has no tensor-parallel plan (train --tp refuses it)"
        for flag, value in (("--heads", shape.heads), ("--kv-heads", shape.kv_heads)):
            if value % degree:
                return f"tensor parallel of {degree} does not divide {flag} {value}"
        if (4 * shape.hidden) % degree:  # the MLP's intermediate features
            return f"tensor parallel of {degree} does not divide the MLP's {4 * shape.hidden}"
        return None


class FolderModel:
    """A Hugging Face folder's own layers, loaded once, one layer to a stage."""

    def __init__(self, args: argparse.Namespace, longest: int) -> None:
        import torch

        from pipetrain.app.config import TrainConfig
        from pipetrain.app.model_folder import folder_config
        from pipetrain.hf import from_pretrained

        given = {opt.dest: getattr(args, opt.dest) for opt in model_options()}
        config = TrainConfig(**given, model_dir=args.model_dir)
        self.hf_config = folder_config(config)  # the checks ``train --model-dir`` makes
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if limit is not None and longest > limit:
            raise ValueError(
                f"--seq-lens reaches {longest}, longer than the model's max_position_embeddings "
                f"{limit} (--model-dir {args.model_dir}/config.json): give lengths <= {limit}"
            )
        self.folder = str(args.model_dir)
        # the embedding, the decoder layers, the final norm and the head: one stage each
        count = self.hf_config.num_hidden_layers + 3
        stages = from_pretrained(self.folder, (1,) * count, dtype=getattr(torch, args.dtype))
        self.layers = [stages[i] for i in range(len(stages))]
        self.names: list[str] | None = list(stages.names)
        self.tied = bool(stages.tied)
        self.label = f"--model-dir {self.folder}"

    def moe_layers(self) -> list[int]:
        """The indices of the layers holding routed experts."""
        return [
            i
            for i, layer in enumerate(self.layers)
            if any(name.endswith("mlp.experts") for name, _ in layer.named_modules())
        ]

    def at(self, seq_len: int) -> tuple[list[Any], Any, Any, int, dict[str, Any]]:
        from pipetrain.hf import causal_lm_loss

        meta = {"model_dir": self.folder, "model": self.hf_config.model_type}
        return self.layers, causal_lm_loss, _labels_are_inputs, self.hf_config.vocab_size, meta

    def tp_refusal(self, degree: int) -> str | None:
        """Why ``train --tp degree`` refuses this folder's family or shape; ``None``: it runs."""
        from pipetrain.hf.families import FAMILIES

        config = self.hf_config
        family = FAMILIES.get(config.model_type)
        if family is None or family.tensor_parallel is None:
            reason = family.tensor_parallel_refusal if family is not None else "no family row"
            return f"{config.model_type} has no tensor-parallel plan ({reason})"
        heads = config.num_attention_heads
        counts = (
            ("attention heads", heads),
            ("key/value heads", getattr(config, "num_key_value_heads", None) or heads),
            ("intermediate size", config.intermediate_size),
        )
        for what, count in counts:
            if count % degree:
                return f"tensor parallel of {degree} does not divide the {count} {what}"
        return None


def _labels_are_inputs(inputs: Any, _: Any) -> tuple[Any, Any]:
    """Hugging Face's loss takes the inputs as labels and shifts them itself."""
    return inputs, inputs


def sample_batch(
    args: argparse.Namespace, batch: Any, vocab: int, seq_len: int, device: Any, seed: int = 0
):
    """The micro-batch the profile runs: ``--microbatch-size`` rows of ``seq_len`` random
    tokens (drawn from ``seed``), as ``(inputs, targets)`` on ``device``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    size = (args.microbatch_size, seq_len)
    tokens = torch.randint(0, vocab, size, generator=gen).to(device)
    inputs, targets = batch(tokens, torch.randint(0, vocab, size, generator=gen))
    return inputs, targets.to(device)


def parallelized(args: argparse.Namespace, seq_len: int, tp_mesh: Any, device: Any) -> Any:
    """One worker's layers at ``seq_len``, on ``device``, split over ``tp_mesh`` as ``train
    --tp`` splits them (a tied embedding and head stay whole), with the profile's batch."""
    from pipetrain.app.launch import quiet_import_notices

    quiet_import_notices()  # before ``transformers`` is imported
    from pipetrain.hf import parallelize_causal_lm
    from pipetrain.runtime.profile.profile_tp_measured import Parallelized

    model = FolderModel(args, seq_len) if args.model_dir else BuiltModel(args)
    layers, loss_fn, batch, vocab, _ = model.at(seq_len)
    layers = [layer.to(device) for layer in layers]
    vocab_parallel = not model.tied  # a tied embedding and head stay whole
    if isinstance(model, FolderModel):  # as ``app.model_folder`` splits each stage
        for layer in layers:
            parallelize_causal_lm(layer, tp_mesh, vocab_parallel=vocab_parallel)
    else:  # as ``app.train`` splits the built model's layers, by their names in the model
        named = dict(zip(model.names or (), layers, strict=True))
        parallelize_causal_lm(named, tp_mesh, vocab_parallel=vocab_parallel)
    inputs, target = sample_batch(args, batch, vocab, seq_len, device)
    sample = inputs if isinstance(inputs, tuple) else (inputs,)
    return Parallelized(layers=layers, loss_fn=loss_fn, inputs=sample, target=target)
