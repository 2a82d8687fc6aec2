"""Megatron-Core's pipeline schedules in ``incumbents.py``: ``get_forward_backward_func()`` over
plain torch modules carrying ``config``, ``model_type``, ``vp_stage`` and ``set_input_tensor``, as
Megatron's own schedule tests build them; nothing of Megatron patched.

Rows (``lib``):

* ``megatron``: 1F1B, ``batch_p2p_comm=True`` with Megatron's default ``batch_p2p_sync=True``
  (a device synchronize after each batched transfer); ``megatron-nosync``: the same with
  ``batch_p2p_sync=False``.
* ``megatron-v{V}[-g{G}][-wf]``: interleaved 1F1B with ``V`` model chunks per rank,
  ``overlap_p2p_comm=True, batch_p2p_comm=False`` (Megatron-LM's setting with virtual stages),
  ``microbatch_group_size_per_vp_stage=G`` (default: the ranks) and, with ``-wf``,
  ``overlap_p2p_comm_warmup_flush=True``.
* ``...-graph`` (any row above): Megatron-Core's own whole-iteration CUDA graph, as Megatron-LM
  runs it with ``--cuda-graph-impl full_iteration``: ``get_forward_backward_func()`` wrapped in
  ``FullCudaGraphWrapper`` (captured after the warm-up steps but one, replayed after; the
  optimizer outside, as in pipetrain's ``pipetrain-graph`` rows), micro-batches read through its
  static buffers (dicts); GPU only.
* ``megatron-gaf``: ``gradient_accumulation_fusion=True``. It acts only inside Megatron's own
  ``ColumnParallelLinear``/``RowParallelLinear`` on weights with a ``main_grad`` buffer (its DDP
  wrapper), through the CUDA extension ``fused_weight_gradient_mlp_cuda`` (apex built with
  ``--cuda_ext``); with plain ``nn.Linear`` it would change nothing, so the row is skipped with
  the reason (the equal-kernel comparison is pipetrain's ``pipetrain-nodefer`` row instead).

Every row: ``deallocate_pipeline_outputs=True`` (Megatron-LM's setting), stages cut as Megatron
cuts them (``megatron_cut`` asks Megatron's ``get_num_layers_to_build`` and checks the row's cut).
Megatron sends ``[s, b, h]``; the model is batch-first, so a chunk reinterprets the received
buffer as ``[b, s, h]`` (a view) and returns its output reinterpreted as ``[s, b, h]`` through one
``clone`` (Megatron frees sent outputs and refuses to free a view).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from torch import nn

from benchmarks.common.gpu_setup import Ctx, make_optimizer
from benchmarks.incumbents.incumbents_runners import profiled
from benchmarks.incumbents.incumbents_shapes import Row, UnitBank
from benchmarks.pipeline.gpu_pipeline import measure


@dataclass(frozen=True)
class Variant:
    v: int = 1
    sync: bool = True
    group: int | None = None  # microbatch_group_size_per_vp_stage; None: the ranks
    warmup_flush: bool = False
    gaf: bool = False
    graph: bool = False


_INTERLEAVED = re.compile(r"megatron-v(\d+)(?:-g(\d+))?(-wf)?$")


def parse(lib: str) -> Variant:
    if lib.endswith("-graph"):
        return dataclasses.replace(parse(lib.removesuffix("-graph")), graph=True)
    if lib == "megatron":
        return Variant()
    if lib == "megatron-nosync":
        return Variant(sync=False)
    if lib == "megatron-gaf":
        return Variant(sync=False, gaf=True)
    m = _INTERLEAVED.match(lib)
    if not m:
        raise ValueError(f"unknown Megatron row {lib!r}")
    group = int(m.group(2)) if m.group(2) else None
    return Variant(v=int(m.group(1)), group=group, warmup_flush=bool(m.group(3)))


def name(v: int, group: int | None, warmup_flush: bool, ranks: int) -> str:
    """The row name of an interleaved variant (the group is left out where it is the ranks)."""
    g = f"-g{group}" if group not in (None, ranks) else ""
    return f"megatron-v{v}{g}{'-wf' * warmup_flush}"


def sweep(vs: list[int], n: int, ranks: int) -> list[str]:
    """Every interleaved variant: each ``v``, group size ``p`` and ``2p`` where the micro-batch
    count allows it (Megatron: ``p <= G <= M``, and the last group either full or ``>= p``),
    with and without warm-up/flush overlap."""
    out = []
    for v in vs:
        for g in (ranks, 2 * ranks):
            if g > n or 0 < n % g < ranks:
                continue
            out += [name(v, g, wf, ranks) for wf in (False, True)]
    return out


class MegatronChunk(nn.Module):
    """One stage as a Megatron model chunk (module doc)."""

    def __init__(self, stage: nn.Module, config, model_type, vp_stage, first: bool, last: bool):
        super().__init__()
        self.stage = stage
        self.config = config
        self.model_type = model_type
        self.vp_stage = vp_stage
        self.first, self.last = first, last
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor) -> None:
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.first:
            assert self.input_tensor is not None
            s, b, h = self.input_tensor.shape
            x = self.input_tensor.view(b, s, h)  # the sender's [b, s, h] bytes, reinterpreted
        out = self.stage(x)
        if self.last:
            return out
        b, s, h = out.shape
        return out.view(s, b, h).clone()  # Megatron frees sent outputs and refuses views


def megatron_cut(row: Row, ranks: int) -> tuple[int, ...]:
    """The units per stage Megatron's own ``get_num_layers_to_build`` gives for the row's shape
    (``account`` shapes: with ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split``), in chain order (stage ``c·P + r``: chunk ``c`` of
    rank ``r``)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    shape, v = row.shape, row.v
    account = shape.cut == "account"
    config = TransformerConfig(
        num_layers=shape.layers,
        hidden_size=shape.hidden,
        num_attention_heads=shape.heads,
        pipeline_model_parallel_size=ranks,
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
        account_for_embedding_in_pipeline_split=account,
        account_for_loss_in_pipeline_split=account,
        pipeline_dtype=torch.bfloat16,
    )
    ends = shape.kind != "blocks"
    cut = []
    for c in range(v):
        for r in range(ranks):
            blocks = get_num_layers_to_build(config, vp_stage=c if v > 1 else None, pp_rank=r)
            first, last = c == 0 and r == 0, c == v - 1 and r == ranks - 1
            cut.append(blocks + ends * (first + last))
    return tuple(cut)


def gaf_skip() -> dict:
    from megatron.core.tensor_parallel import layers

    have = getattr(layers, "_grad_accum_fusion_available", False)
    why = (
        "the CUDA extension fused_weight_gradient_mlp_cuda is importable, but"
        if have
        else "needs the CUDA extension fused_weight_gradient_mlp_cuda (apex --cuda_ext), not "
        "installed; and"
    )
    return {
        "skipped": f"gradient_accumulation_fusion: {why} it acts only in Megatron's own "
        "Column/RowParallelLinear with main_grad buffers, not in the plain nn.Linear every "
        "library runs here (see pipetrain-nodefer for equal kernels)"
    }


@contextlib.contextmanager
def cpu_shim():
    """CPU smoke only (gloo): Megatron's schedules put a token counter on ``device="cuda"`` and
    their transfer buffers on ``torch.cuda.current_device()``; here both go to the CPU and
    ``torch.cuda.synchronize`` does nothing, so the plumbing (chunks, cuts, every variant's
    config) runs end to end before any GPU time. Never used on a GPU."""
    from megatron.core.pipeline_parallel import schedules

    def zeros(*args, device=None, **kw):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kw)

    shim = types.SimpleNamespace(**{k: getattr(torch, k) for k in dir(torch) if not k[:2] == "__"})
    shim.zeros = zeros
    saved = (schedules.torch, torch.cuda.current_device, torch.cuda.synchronize)
    schedules.torch = shim
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        yield
    finally:
        schedules.torch, torch.cuda.current_device, torch.cuda.synchronize = saved


def run_megatron(ctx: Ctx, bank: UnitBank, row: Row) -> dict:
    from megatron.core import ModelParallelConfig, parallel_state

    var = parse(row.lib)
    if var.gaf:
        return gaf_skip()
    if var.graph and not ctx.cuda:
        return {"skipped": "Megatron's full-iteration CUDA graph needs a GPU"}
    expect = megatron_cut(row, ctx.world)
    if expect != row.cut:
        raise RuntimeError(f"cut {row.cut} is not Megatron's {expect}")
    interleaved = var.v > 1
    vp = var.v if interleaved else None
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=ctx.world,
        virtual_pipeline_model_parallel_size=vp,
        create_gloo_process_groups=False,
    )
    if var.graph:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        # the whole-iteration graph registers every tracked generator (as Megatron-LM seeds
        # them when a CUDA graph implementation is chosen)
        model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True, force_reset_rng=True)
    try:
        config = ModelParallelConfig(
            pipeline_model_parallel_size=ctx.world,
            virtual_pipeline_model_parallel_size=vp,
            pipeline_dtype=ctx.dtype,
            params_dtype=ctx.dtype,
            overlap_p2p_comm=interleaved,
            batch_p2p_comm=not interleaved,
            batch_p2p_sync=var.sync,
            deallocate_pipeline_outputs=True,
            overlap_p2p_comm_warmup_flush=var.warmup_flush,
            microbatch_group_size_per_vp_stage=var.group,
        )
        config.hidden_size = row.shape.hidden  # as Megatron's schedule tests set it
        with contextlib.nullcontext() if ctx.cuda else cpu_shim():
            out = _measure(ctx, bank, row, config, interleaved, var.graph)
            return out | {"cpu_shim": not ctx.cuda}
    finally:
        parallel_state.destroy_model_parallel()


def _measure(ctx: Ctx, bank: UnitBank, row: Row, config, interleaved: bool, graph: bool) -> dict:
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func

    mine = row.local(ctx.rank, ctx.world)
    last = row.num_stages - 1
    base = ctx.mem_reset()
    chunks = [
        MegatronChunk(
            bank.stage(row.shape, row.cut, s),
            config,
            ModelType.encoder_or_decoder,
            c if interleaved else None,
            s == 0,
            s == last,
        )
        for c, s in enumerate(mine)
    ]
    params = [p for m in chunks for p in m.parameters()]
    opt = make_optimizer(ctx, params)
    x, y = row.shape.batch(ctx.device, ctx.dtype, row.n)
    # dicts: the full-iteration graph's static buffers take a micro-batch as a dict
    batches = [{"x": xb, "y": yb} for xb, yb in zip(x.chunk(row.n), y.chunk(row.n))]
    loss_fn = row.shape.loss

    def loss_func(target, output):
        loss = loss_fn(output, target)
        return loss, {"loss": loss.detach()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return model(batch["x"]), functools.partial(loss_func, batch["y"])

    fb = get_forward_backward_func()
    if graph:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader

        # class-level state: a row starts from none (capture after the warm-up steps but one)
        StaticBufferLoader.static_buffers = {"training": [], "validation": []}
        fb = FullCudaGraphWrapper(fb, cuda_graph_warmup_steps=max(1, ctx.args.warmup - 1))
        fb.reset_cuda_graph()

    def step() -> None:
        iters = [iter(batches) for _ in chunks]
        fb(
            forward_step_func=forward_step,
            data_iterator=iters if interleaved else iters[0],
            model=chunks if interleaved else chunks[0],
            num_microbatches=row.n,
            seq_length=row.shape.seq,
            micro_batch_size=row.shape.mb_size,
            forward_only=False,
        )

    try:
        out, _ = measure(ctx, step, opt, params, base)
        out["function"] = getattr(fb, "__name__", type(fb).__name__)
        out.update(profiled(ctx, row, step, opt, params))
    finally:
        if graph:
            fb.reset_cuda_graph()  # type: ignore[attr-defined]
    return out
