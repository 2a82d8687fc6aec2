"""Every check of a ``pipetrain train`` run that reads files or spans fields, and the pipeline
layout the run's config resolves to.

``check_arguments`` checks the model's shape (or the ``--model-dir`` folder's, with its
tokenizer and the ``--export`` folder: ``app.model_folder``), the data, the plan file and the
checkpoint to resume, and turns the config into a ``Layout``: the plan in ``--plan FILE``
(``pipetrain plan --json``, read as ``Layout.from_json`` reads it, as ``Pipeline.from_plan``
does), or the shape flags with the default cut (blocks spread evenly, embedding and head on the
end stages). The launcher calls it before any process starts, so bad input exits 2 at once rather
than in every worker; each worker calls it again for its layout. It stands above every module
whose checks it runs (``TrainConfig`` itself, in ``app.config``, imports none of them).

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pipetrain.app import kernels
from pipetrain.app.batch_source import check_folder_data, length_cost, step_budget
from pipetrain.app.catalog import ModelShape, default_stage_layers
from pipetrain.app.checkpoints import Checkpoints, check_directory
from pipetrain.app.config import (
    DEFAULT_MICROBATCHES,
    DEFAULT_RANKS,
    DEFAULT_SCHEDULE,
    TrainConfig,
    flags_given,
)
from pipetrain.app.evaluation import check_eval
from pipetrain.app.lr_schedule import resolve_schedule
from pipetrain.app.metrics import check_metrics
from pipetrain.app.model_folder import check_export, check_family_flags, router_line, run_shape
from pipetrain.planner.layout import Layout
from pipetrain.schedule.registry import FAMILIES, build_schedule, family


def check_arguments(config: TrainConfig) -> Layout:
    """Check everything that needs no process; return the pipeline layout.

    Raises ``ValueError`` naming the bad value and the legal ones.
    """
    shape = run_shape(config)
    _check_expert_parallel(config)
    if config.model_dir is not None:  # what the folder's family cannot run (tp, packing, router)
        check_family_flags(config, shape.model)
    _check_expert_bias(config, shape.model)
    _check_data_flags(config)
    _check_experts(config, shape.model)
    _check_token_budget(config)
    if config.resume and config.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if config.checkpoint_every is not None and config.checkpoint_dir is None:
        raise ValueError("--checkpoint-every needs --checkpoint-dir DIR")
    _check_tensor_parallel(config, shape)
    resolve_schedule(config)
    check_metrics(config)
    if not config.worker:  # the launcher's: workers may find this run's first files
        check_directory(config)
        check_export(config)
    if config.resume and config.checkpoint_dir is not None:  # complete and of this model
        Checkpoints(config.checkpoint_dir, shape).latest()
    layout = _layout(config, shape)
    _check_cuda_graph(config)
    kernels.check(config)
    if config.model_dir is None:
        _check_text(config, layout)
    elif not config.worker:  # tokenized once, by the launcher
        check_data(config, shape.vocab)
        routed = router_line(config)
        if _expert_bias_balanced(config, shape.model):  # balanced by the bias, not a loss
            routed = _expert_bias_line(config)
        if routed is not None:
            print(routed, flush=True)
    if not config.worker:
        check_eval(config, config.microbatch_size * layout.microbatches * config.dp)
    if shape.num_layers < len(layout.stage_layers):
        more = shape.num_layers - len(layout.stage_layers)
        raise ValueError(
            f"{_blocks(config, shape)} gives {shape.num_layers} layers (with the embedding and "
            f"head) for {len(layout.stage_layers)} stages; every stage needs a layer: "
            + (
                f"use --layers >= {config.layers - more}"
                if config.model_dir is None
                else "use fewer stages"
            )
        )
    if sum(layout.stage_layers) != shape.num_layers:
        raise ValueError(
            f"the plan in {config.plan} cuts {sum(layout.stage_layers)} layers "
            f"{list(layout.stage_layers)}, but {_blocks(config, shape)} has {shape.num_layers}; "
            "plan from a profile of the same model"
            + (
                f" (`pipetrain profile --model {config.model} --layers {config.layers}`)"
                if config.model_dir is None
                else ""
            )
        )
    return layout


def _expert_bias_balanced(config: TrainConfig, model_type: str) -> bool:
    """Whether the folder's family balances its experts with a per-expert routing bias."""
    if config.model_dir is None:
        return False
    from pipetrain.hf import families

    return families.FAMILIES[model_type].expert_bias


def _check_expert_bias(config: TrainConfig, model_type: str) -> None:
    """``--expert-bias-rate`` only where the model's routers have the bias it moves."""
    if flags_given(config, ("expert_bias_rate",)) and not _expert_bias_balanced(config, model_type):
        held = (
            f"--model-dir {config.model_dir} holds a {model_type!r} model"
            if config.model_dir is not None
            else f"the built-in --model {config.model}"
        )
        raise ValueError(
            f"--expert-bias-rate {config.expert_bias_rate:g}: {held}, whose routers have no "
            "per-expert bias (auxiliary-loss-free balancing: DeepSeek-V3); drop it"
        )


def _expert_bias_line(config: TrainConfig) -> str:
    rate = config.expert_bias_rate
    if rate == 0:
        return (
            "expert bias balancing off (--expert-bias-rate 0): the routers' biases stay as loaded"
        )
    return (
        f"expert bias balancing on: each router's per-expert bias moves by {rate:g} after every "
        "optimizer step, towards the experts below the mean load (--expert-bias-rate 0 keeps it)"
    )


#: the flags that say how a ``--model-dir`` folder's tokenizer reads the data (the built-in
#: models read a text file's bytes as they are)
FOLDER_DATA_FIELDS = (
    *("text_unit", "packing", "long_documents", "data_cache", "microbatch_balance"),
    *("global_batch_tokens", "costs"),
)


def _check_data_flags(config: TrainConfig) -> None:
    """``--data`` and ``--eval-data`` exist (a file, or a ``datasets`` folder with
    ``--model-dir``); the flags for tokenized data need ``--model-dir``."""
    folder = config.model_dir is not None
    for flag, path in (("--data", config.data), ("--eval-data", config.eval_data)):
        if path is None:
            continue
        if not Path(path).exists() or (Path(path).is_dir() and not folder):
            raise ValueError(f"{flag} {path}: no such file")
        if not folder and Path(path).suffix not in ("", ".txt"):
            raise ValueError(
                f"{flag} {path}: the built-in models read a text file's bytes; JSONL, chat, "
                "parquet and datasets folders need a tokenizer: give --model-dir DIR"
            )
    if not folder:
        given = flags_given(config, FOLDER_DATA_FIELDS)
        if given:
            raise ValueError(
                f"{', '.join(given)}: for a --model-dir folder's tokenized data (the built-in "
                "models read the text's bytes); drop it or give --model-dir DIR"
            )


def _check_experts(config: TrainConfig, model: str) -> None:
    """``--experts`` only for a mixture-of-experts folder, and ``grouped`` not in float64 (no
    grouped GEMM takes it)."""
    if config.experts == "auto":
        return
    flag = f"--experts {config.experts}"
    if config.model_dir is None:
        raise ValueError(
            f"{flag}: the built-in --model {config.model} has no experts; it is for a "
            "mixture-of-experts --model-dir folder: drop it"
        )
    from pipetrain.hf.families import FAMILIES as MODEL_FAMILIES

    if model in MODEL_FAMILIES and not MODEL_FAMILIES[model].is_moe:
        raise ValueError(
            f"{flag}: --model-dir {config.model_dir} holds a dense {model!r} model, which has "
            "no experts; drop it"
        )
    if config.experts == "grouped" and config.dtype == "float64":
        raise ValueError(f"{flag}: no grouped GEMM takes float64; use --experts loop or auto")


def _check_token_budget(config: TrainConfig) -> None:
    """``--global-batch-tokens`` packs documents and sets each step's micro-batch count, so it
    takes no ``-m``, plan or captured step; ``--costs`` weighs documents for length-balanced
    packing. Both read as the run reads them (the budget holds the fewest micro-batches the
    schedule runs, the costs file has length coefficients)."""
    budget = config.global_batch_tokens
    if budget is not None:
        if config.packing == "none":
            raise ValueError(
                "--global-batch-tokens packs documents up to a token budget; drop --packing none "
                "or give -m N micro-batches of padded rows instead"
            )
        for given, flag in ((config.microbatches, "-m/--microbatches"), (config.plan, "--plan")):
            if given is not None:
                raise ValueError(
                    f"--global-batch-tokens sets each step's micro-batch count; drop {flag} or "
                    "--global-batch-tokens"
                )
        if config.cuda_graph:
            raise ValueError(
                "--global-batch-tokens changes the micro-batch count between steps, which a "
                "captured step cannot; drop --cuda-graph or --global-batch-tokens"
            )
        step_budget(config)
    if config.costs is not None:
        if config.packing == "none" or config.microbatch_balance == "fixed":
            raise ValueError(
                "--costs balances packed micro-batches by length; it needs --packing documents "
                "and --microbatch-balance length"
            )
        length_cost(config)


def _check_expert_parallel(config: TrainConfig) -> None:
    """``--ep``: a mixture-of-experts folder whose experts ``E`` divides, ``E`` dividing
    ``--dp`` (expert parallel borrows from data parallel), no tensor parallel."""
    ep = config.ep
    if ep == 1:
        return
    if config.tp > 1:
        raise ValueError(
            f"--ep {ep} with --tp {config.tp} needs expert tensor parallel, which pipetrain "
            "does not have yet; use --tp 1"
        )
    if config.dp % ep:
        raise ValueError(
            f"--ep {ep} must divide --dp {config.dp} (expert parallel shards the experts over "
            f"ep of the data-parallel replicas): give --dp a multiple of {ep}"
        )
    if config.model_dir is None:
        raise ValueError(
            f"--ep {ep} needs a mixture-of-experts --model-dir folder; the built-in "
            f"--model {config.model} is dense: drop --ep"
        )
    from pipetrain.app.model_folder import folder_config
    from pipetrain.hf.families import family_of

    hf_config = folder_config(config)
    family = family_of(hf_config)
    if not family.is_moe:
        raise ValueError(
            f"--ep {ep}: --model-dir {config.model_dir} holds a dense {family.model_type!r} "
            "model, which has no experts to shard: drop --ep"
        )
    if family.expert_parallel is None:
        raise ValueError(
            f"--ep {ep}: expert parallel is not built for {family.model_type!r} models yet; "
            "drop --ep"
        )
    experts = int(getattr(hf_config, family.num_experts))
    if experts % ep:
        raise ValueError(
            f"--ep {ep} must divide the number of experts ({experts} in --model-dir "
            f"{config.model_dir}): give an --ep that does"
        )


def _check_cuda_graph(config: TrainConfig) -> None:
    """``--cuda-graph`` where the runtime captures a step (docs/runtime.md, "Whole-step CUDA
    graphs"): on GPUs, no data or tensor parallel."""
    if not config.cuda_graph:
        return
    if config.device == "cpu":
        raise ValueError("--cuda-graph captures each step on a GPU; drop it or --device cpu")
    if config.dp > 1 or config.tp > 1:
        raise ValueError(
            "--cuda-graph with --dp or --tp is not supported yet (their gradient syncs keep "
            "host-side state per step); drop --cuda-graph or run --dp 1 --tp 1"
        )


def _blocks(config: TrainConfig, shape: ModelShape) -> str:
    """The flags that gave the model's layers, to name them."""
    if config.model_dir is not None:
        return f"--model-dir {config.model_dir} ({shape.blocks} decoder layers)"
    return f"--model {config.model} --layers {config.layers}"


def _check_tensor_parallel(config: TrainConfig, shape: ModelShape) -> None:
    """``--tp``: the Llama family's plan (``pipetrain.hf.parallelize_causal_lm``) splits heads,
    key/value heads and the MLP's intermediate features (4 × hidden) over the tp ranks, and with
    ``--sequence-parallel`` the tokens."""
    if config.sequence_parallel and config.tp == 1:
        raise ValueError("--sequence-parallel needs --tp N with N > 1")
    if config.tp == 1:
        return
    if config.model_dir is None and shape.model == "gpt":
        raise ValueError(
            "--tp needs a Hugging Face Llama-family model (--model llama, qwen3 or mistral, or a "
            f"--model-dir of one); {shape.model} has no tensor-parallel plan"
        )
    if config.data_parallel == "ddp" and config.dp > 1:
        raise ValueError("--tp with --dp needs --data-parallel fsdp (DDP replicates plain tensors)")
    for flag, value in (
        ("--heads", shape.heads),
        ("--kv-heads", shape.kv_heads),
        ("--hidden", shape.hidden),
    ):
        if value % config.tp:
            raise ValueError(f"--tp {config.tp} must divide {flag} {value}")
    if config.sequence_parallel and config.seq_len % config.tp:
        raise ValueError(
            f"--sequence-parallel shards the tokens: --tp {config.tp} must divide --seq-len "
            f"{config.seq_len}"
        )


def _check_text(config: TrainConfig, layout: Layout) -> None:
    """``--data`` holds one batch of the asked shape: every row a window of ``--seq-len`` bytes
    and the byte after it (its target)."""
    if config.data is None:
        return
    rows = config.microbatch_size * layout.microbatches * config.dp
    need = rows * (config.seq_len + 1)
    size = Path(config.data).stat().st_size
    if size < need:
        raise ValueError(
            f"--data {config.data} has {size} bytes; one batch of {rows} rows (--microbatch-size "
            f"{config.microbatch_size} × --microbatches {layout.microbatches} × --dp {config.dp}) "
            f"of --seq-len {config.seq_len} bytes and a target byte each needs at least {need}: "
            "give a longer text, or smaller flags"
        )


def _layout(config: TrainConfig, shape: ModelShape) -> Layout:
    if not family(config.schedule or DEFAULT_SCHEDULE).runnable:  # family() names unknown ones
        runnable = ", ".join(f.name for f in FAMILIES.values() if f.runnable)
        raise ValueError(
            f"{config.schedule} is for planning only (two copies of the model); train with one "
            f"of {runnable}"
        )
    if config.plan is not None:
        given = config.shape_flags_given()
        if given:
            raise ValueError(
                f"--plan {config.plan} gives the schedule and its shape; drop {', '.join(given)}"
            )
        layout = _read_plan(config.plan)
        _check_plan_sizes(config, layout)
        return layout
    budget = step_budget(config)  # a token budget: the count of a step its tokens fill
    program = build_schedule(
        config.schedule or DEFAULT_SCHEDULE,
        config.ranks or DEFAULT_RANKS,
        config.microbatches or (DEFAULT_MICROBATCHES if budget is None else budget.nominal),
        config.stages_per_rank,
    )
    if program.num_stages > shape.num_layers:
        # one layer a stage: refused by the caller, which names the layer count
        counts: tuple[int, ...] = (1,) * program.num_stages
    else:
        counts = default_stage_layers(shape.model, shape.blocks, program.num_stages)
    modes = _recompute_modes(config.recompute, program.num_stages)
    try:
        return Layout(
            schedule=program.name,
            ranks=program.num_ranks,
            stages_per_rank=program.num_stages // program.num_ranks,
            microbatches=program.num_microbatches,
            stage_layers=tuple(counts),
            recompute=modes,
        )
    except ValueError as e:
        raise ValueError(f"--recompute {config.recompute}: {e}") from None


def _recompute_modes(flag: str | None, num_stages: int) -> tuple[str, ...]:
    """``--recompute`` per stage: one mode for all, or one per stage (checked by ``Layout``
    against each stage's layers)."""
    if flag is None:
        return ()
    modes = tuple(m.strip() for m in flag.split(","))
    if len(modes) == 1:
        return modes * num_stages
    if len(modes) != num_stages:
        raise ValueError(
            f"--recompute {flag} gives {len(modes)} modes for {num_stages} stages; give one mode "
            "for every stage or one per stage"
        )
    return modes


def _check_plan_sizes(config: TrainConfig, layout: Layout) -> None:
    """An N-D plan (``pipetrain plan --gpus``) was priced for its tensor- and data-parallel
    sizes: a run with others would not be the plan's, so ``--tp`` and ``--dp`` must match; a
    pipeline-only plan (``--ranks``) gives neither and leaves them to the run."""
    if layout.tp is None and layout.dp is None:
        return
    if (config.tp, config.dp) != (layout.tp or 1, layout.dp or 1):
        raise ValueError(
            f"--plan {config.plan} is planned for --tp {layout.tp or 1} --dp {layout.dp or 1}, not "
            f"--tp {config.tp} --dp {config.dp}: give --tp {layout.tp or 1} --dp "
            f"{layout.dp or 1}, or plan again"
        )


def _read_plan(path: str) -> Layout:
    try:
        raw = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"--plan {path}: no such file") from None
    except json.JSONDecodeError as e:
        raise ValueError(
            f"--plan {path} is not JSON ({e}); write it with `pipetrain plan --json`"
        ) from None
    try:
        layout = Layout.from_json(raw)
    except ValueError as e:
        raise ValueError(f"--plan {path}: {e}") from None
    if layout.program is not None:  # a synthesized program: checked by Layout.from_json
        return layout
    program = build_schedule(
        layout.schedule, layout.ranks, layout.microbatches, layout.stages_per_rank
    )
    if not family(program.name).runnable or program.placement.num_chains > 1:
        raise ValueError(f"--plan {path}: {program.name} holds two copies of the model")
    return dataclasses.replace(layout, schedule=program.name)


def check_data(config: TrainConfig, vocab: int) -> None:
    """The launcher's check of the folder's data: ``--data`` and ``--eval-data`` tokenized once
    by the folder's tokenizer into the data cache, their ids within the model's ``vocab``; what
    it found is printed (``app.batch_source.check_folder_data``)."""
    for line in check_folder_data(config, vocab):
        print(line, flush=True)
    if config.packing == "documents" and config.microbatch_balance == "length":
        print(length_cost(config)[1], flush=True)


__all__ = ["check_arguments", "check_data"]
