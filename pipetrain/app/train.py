"""``pipetrain train``'s training loop: one worker's steps, inside an initialised process group of
ranks × dp processes (``app.launch`` starts them).

A worker builds its own stages (same seed everywhere, so the weights equal the unsplit model's)
and runs them with ``Pipeline.from_plan`` on the run's layout (``app.config``); with
``--model-dir`` it loads its stages from the folder instead (``app.model_folder``), and
``--export`` writes the folder back at the end. Its batches come from ``app.batch_source`` (the
bytes of ``--data``, by default the corpus ``app.models.data`` generates, written to
``--corpus-out`` first; a folder tokenizer's padded rows with ``--model-dir``). It trains with
AdamW at each step's rate from ``app.lr_schedule`` (``--clip-grad-norm``: clipped by the whole
pipeline's norm), evaluates ``--eval-data`` when due (``app.evaluation``), records each step
with ``--metrics`` / ``--tensorboard`` (``app.metrics``), writes checkpoints every
``--checkpoint-every`` steps (``app.checkpoints``; ``--resume`` continues from the latest one,
bit for bit on the same layout, and says which), and on rank 0 shows a progress bar (loss,
tokens/s). The last ``MEASURED_STEPS`` steps are measured (``timeline=True``) for the
end-of-run report (``app.report``). What the pipeline refuses at construction is raised as
``Refused``, the same on every rank; a loss or gradient norm that is not finite raises
``NonFinite`` before that step's update (``--on-nonfinite skip``: the update is skipped, up to
``--max-skipped`` steps in a row), the same on every rank too, since every rank returns the same
loss and norm.

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipetrain.app.batch_source import StepBatch
from pipetrain.app.config import TrainConfig
from pipetrain.app.evaluation import eval_due
from pipetrain.app.garbage_collection import GarbageCollection
from pipetrain.app.lr_schedule import LrSchedule, set_lr
from pipetrain.app.model_folder import run_shape
from pipetrain.app.report import Progress, run_report
from pipetrain.app.termination import TermWatch
from pipetrain.app.train_checks import check_arguments
from pipetrain.schedule.timeline import Timeline

if TYPE_CHECKING:
    import torch

    from pipetrain.app.catalog import LayerModel
    from pipetrain.planner.layout import Layout
    from pipetrain.runtime.pipeline import Pipeline

MEASURED_STEPS = 5  # the last steps run with timeline=True; the median one is reported
#: ``--weight-grads`` → ``Pipeline(defer_weight_grads=...)``
_DEFER = {"auto": None, "deferred": True, "replay": False}


class Refused(ValueError):
    """The pipeline refused the configuration at construction (the same on every rank)."""


class NonFinite(ArithmeticError):
    """The loss was nan or inf and ``--on-nonfinite stop`` (the same on every rank: every rank
    returns the same loss)."""


@dataclass
class Run:
    """What a worker's training loop gives back."""

    losses: list[float]
    #: the step each loss belongs to (from the first step run, after a resume)
    first_step: int
    state: dict[str, Any] = field(default_factory=dict)
    report: str = ""


def train(config: TrainConfig, device: torch.device) -> Run:
    """One worker's training loop, inside an initialised process group of ranks × dp."""
    import torch
    import torch.distributed as dist

    from pipetrain.app import checkpoints
    from pipetrain.app.batch_source import train_batches
    from pipetrain.app.catalog import build
    from pipetrain.app.data.prefetch import prefetch
    from pipetrain.app.lr_schedule import parameter_groups, resolve_schedule

    layout = check_arguments(config)
    rank = dist.get_rank()
    model = build(config.shape) if config.model_dir is None else None  # None: the folder's
    pipe, replica = _pipeline(config, layout, model, device)
    schedule = resolve_schedule(config)
    saver = (
        checkpoints.Checkpoints(
            config.checkpoint_dir,
            run_shape(config),
            overwrite=config.overwrite_checkpoints,
            verify=config.verify_checkpoint,
            asynchronous=config.async_checkpoint,
            keep=config.keep_checkpoints,
            timeout=config.timeout,
        )
        if config.checkpoint_dir
        else None
    )
    term = TermWatch(config, device)  # --checkpoint-on-term: SIGTERM noted, agreed each step
    # closed at the end: a captured step (--cuda-graph) holds NCCL's communicators until its
    # pipeline lets go, and the worker destroys its process group next; a checkpoint still being
    # written (--async-checkpoint) is waited for, then the checkpoint folder's lock is let go,
    # so the next run of this process may take it
    with pipe, saver if saver is not None else contextlib.nullcontext(), term:
        groups = parameter_groups(pipe.parameters(), config.weight_decay)
        opt = torch.optim.AdamW(groups, lr=schedule.lr, betas=(0.9, 0.95))
        start = _resume(config, saver, pipe, opt, rank)
        pipe.dropout_keys.step = start  # a resumed run draws the straight run's masks
        local = config.microbatch_size * layout.microbatches
        mine = slice(replica * local, (replica + 1) * local)
        steps = Steps(config, pipe, opt, schedule, device, mine, start, local * config.dp)
        steps.replica = replica  # its share of a step of its own count (--global-batch-tokens)
        every = config.checkpoint_every or config.steps
        # the next steps' batches are built while this one runs (``app.data.prefetch``;
        # --prefetch-batches 0: each in the loop)
        data = prefetch(
            train_batches(config, model, layout.microbatches, start), config.prefetch_batches
        )
        try:
            with GarbageCollection(config.gc_every) as collector:
                for step in range(start, config.steps):
                    waited = time.perf_counter()
                    batch = next(data)  # built ahead (--prefetch-batches), or here
                    steps.run(step, batch, time.perf_counter() - waited)
                    collector.step(step + 1)
                    due = (step + 1) % every == 0 or step + 1 == config.steps
                    # collective, every step: every rank stops after the same one
                    stop = term.agreed() and step + 1 < config.steps
                    saved = saver.save(step + 1, pipe, opt) if saver and (due or stop) else None
                    if stop:
                        raise term.stopped(step + 1, config.steps, saved)
        finally:
            steps.close()
            data.close()
        if config.export is not None:
            from pipetrain.app.model_folder import export

            export(config, pipe)
        state = {k: v.detach().clone() for k, v in _local_state(pipe).items()}
        run = Run(steps.losses, start, state)
        if rank == 0:
            cpu_processes = dist.get_world_size() if device.type == "cpu" else 0
            run.report = run_report(config, steps, pipe, cpu_processes)
        return run


def _resume(config: TrainConfig, saver, pipe: Pipeline, opt, rank: int) -> int:
    """The step to start from: the latest checkpoint's with ``--resume`` (loaded into ``pipe``
    and ``opt``, and named on rank 0), else 0; ``Refused`` when there is nothing left to run."""
    if saver is None:
        return 0
    try:
        saver.hold()  # one writer per folder, from now until the run ends
        if not config.resume:
            return 0
        start: int = saver.resume(pipe, opt)
    except ValueError as e:
        raise Refused(str(e)) from None
    if start >= config.steps:
        raise Refused(
            f"the checkpoint in {config.checkpoint_dir} is at step {start}; --steps {config.steps} "
            "leaves nothing to run (give more steps)"
        )
    if rank == 0:
        folder = saver.directory / f"step-{start:06d}"
        print(f"resuming from {folder} (step {start} of {config.steps})", flush=True)
    return start


class Steps:
    """The loop's steps one at a time: the scheduled rate, the pipeline's step, the update (or
    its skip), the progress line, the evaluation when due and the metrics record; it keeps the
    losses, the measured timelines and the skipped steps for the report."""

    def __init__(
        self,
        config: TrainConfig,
        pipe: Pipeline,
        opt: Any,
        schedule: LrSchedule,
        device: torch.device,
        mine: slice,
        start: int,
        rows: int,
    ) -> None:
        import torch.distributed as dist

        from pipetrain.app import metrics

        self.config, self.pipe, self.opt, self.schedule = config, pipe, opt, schedule
        self.device, self.mine = device, mine
        lead = dist.get_rank() == 0
        self.bar = Progress(config.steps, enabled=lead, start=start)
        self.log = metrics.MetricsLog(config, start, enabled=lead)
        self.recorded = config.metrics is not None or config.tensorboard is not None
        self.flops, self.peak = 0, None
        if self.recorded:  # collective: every rank counts its parameters
            shape = run_shape(config)
            matmul = metrics.matmul_parameters(pipe)
            self.flops = metrics.flops_per_token(matmul, shape.blocks, shape.hidden, shape.seq_len)
            peak = metrics.peak_flops(device, config.dtype)
            self.peak = None if peak is None else peak * dist.get_world_size()
        self.eval_set: list[StepBatch] | None = None
        self.rows = rows
        self.losses: list[float] = []
        self.measured: list[Timeline] = []
        #: the program each measured step ran (its own count's, under --global-batch-tokens)
        self.measured_programs: list[Any] = []
        #: each step's micro-batch count, under --global-batch-tokens (else empty)
        self.counts: list[int] = []
        self.skips = Skips(config)
        self.evals: list[tuple[int, float]] = []
        self.replica = 0

    def run(self, step: int, batch: StepBatch, waited: float = 0.0) -> None:
        """Step ``step`` (0-based) on ``batch`` (every replica's rows), after ``waited`` seconds
        for it: the loop's real tokens per second count that wait, as torchtitan's do (its
        ``data_loading_time``), so a batch built between steps shows in the rate it costs."""
        config, pipe = self.config, self.pipe
        count = batch.microbatches  # None: the pipeline's own
        mine = self.mine if count is None else batch.share(self.replica, config.dp)
        local = batch.rows(mine, self.device)
        # a captured step replays as one: no per-action timeline to measure
        timed = not config.cuda_graph and step >= config.steps - MEASURED_STEPS
        t0 = time.perf_counter()
        lr = self.schedule.at(step)
        set_lr(self.opt, lr)
        self.opt.zero_grad(set_to_none=True)
        loss = pipe.step(
            local.inputs, local.targets, timeline=timed, side=local.side, num_microbatches=count
        )
        norm = self._update(loss, lr, step + 1)
        self.losses.append(float(loss))
        rate = batch.real_tokens / (time.perf_counter() - t0 + waited)
        shown = None if norm is None else float(norm)
        self.bar.update(step + 1, self.losses[-1], rate, shown if config.clip_grad_norm else None)
        if count is not None:
            self.counts.append(count)
        if timed and pipe.last_timeline is not None:
            self.measured.append(pipe.last_timeline)
            self.measured_programs.append(pipe.program)  # the program of this step's count
        eval_loss = self._evaluate() if eval_due(config, step + 1) else None
        if eval_loss is not None:
            self.bar.note(f"step {step + 1}: eval loss {eval_loss:.4f} (--eval-data)")
            self.evals.append((step + 1, eval_loss))
        if self.recorded:
            record = {
                "step": step + 1,
                "loss": self.losses[-1],
                "lr": lr,
                "grad_norm": shown,
                "tokens": batch.real_tokens,
                "padding_tokens": batch.padding_tokens,
                "tok_per_s": rate,
                "data_ms": 1e3 * waited,
                "mfu": None if self.peak is None else self.flops * rate / self.peak,
                **{f"aux_loss/{name}": value for name, value in pipe.extra_losses.items()},
                **({} if count is None else {"microbatches": count}),  # --global-batch-tokens
            }
            self.log.write(record | ({} if eval_loss is None else {"eval_loss": eval_loss}))

    def _update(self, loss: torch.Tensor, lr: float, step: int) -> torch.Tensor | None:
        """The optimizer's update after ``step``'s backward, clipped first with
        ``--clip-grad-norm`` (its norm returned; measured unclipped when metrics are written),
        unless the loss or the norm is not finite: then ``Skips`` skips it or stops the run.
        Every rank holds the same loss and norm, so every rank decides alike."""
        from pipetrain.hf.expert_bias import reset_expert_loads, update_expert_biases

        config, pipe = self.config, self.pipe
        what = None if pipe.loss_is_finite(loss) else f"the loss is {float(loss)}"
        norm = None
        if what is None and (config.clip_grad_norm or self.recorded):
            norm = pipe.clip_grad_norm_(config.clip_grad_norm or float("inf"))
            what = None if pipe.loss_is_finite(norm) else f"the gradient norm is {float(norm)}"
        if what is not None:
            self.skips.skip(what, step, lr)
            self.opt.zero_grad(set_to_none=True)
            reset_expert_loads(pipe.modules.values())  # the skipped step's loads move nothing
            return None
        self.skips.passed()
        self.opt.step()
        # DeepSeek-V3's auxiliary-loss-free balancing: loads summed over micro-batches and dp
        dp = pipe.data_parallel
        group = None if dp is None else dp.group
        update_expert_biases(pipe.modules.values(), config.expert_bias_rate, group)
        return norm

    def _evaluate(self) -> float:
        from pipetrain.app.batch_source import eval_batches
        from pipetrain.app.evaluation import evaluate

        if self.eval_set is None:
            self.eval_set = eval_batches(self.config, self.config.model_dir is not None, self.rows)
        return evaluate(self.pipe, self.eval_set, self.mine, self.device)

    def close(self) -> None:
        self.bar.close()
        self.log.close()


class Skips:
    """``--on-nonfinite``: a step whose loss or gradient norm is not finite stops the run
    (``stop``), or has its update skipped (``skip``) until ``--max-skipped`` consecutive steps
    were, which stops it too: a run whose every step is skipped trains nothing."""

    def __init__(self, config: TrainConfig) -> None:
        self.config = config
        self.steps: list[int] = []
        self.consecutive: list[int] = []

    def skip(self, what: str, step: int, lr: float) -> None:
        """Record step ``step``'s skip, or raise ``NonFinite`` naming it."""
        config = self.config
        if config.on_nonfinite == "stop":
            raise NonFinite(
                f"{what} at step {step}: stopped before its optimizer step (lower --lr, "
                f"{lr:g} at that step, or clip with --clip-grad-norm; --on-nonfinite skip skips "
                "such steps instead)"
            )
        self.steps.append(step)
        self.consecutive.append(step)
        if len(self.consecutive) >= config.max_skipped:
            shown = ", ".join(map(str, self.consecutive))
            raise NonFinite(
                f"{what} at step {step}: stopped after {len(self.consecutive)} consecutive "
                f"skipped steps ({shown}; --max-skipped {config.max_skipped}); lower --lr or "
                "clip with --clip-grad-norm"
            )

    def passed(self) -> None:
        self.consecutive = []


def _pipeline(
    config: TrainConfig, layout: Layout, model: LayerModel | None, device: torch.device
) -> tuple[Pipeline, int]:
    """This worker's pipeline on the layout (on a (pp, dp, tp) mesh when ``--dp`` or ``--tp`` >
    1, the layers tensor-parallelized by the Llama family's plan), and its data-parallel
    replica; ``Refused`` with the pipeline's message when it refuses. ``model`` None: the
    ``--model-dir`` folder's stages (``app.model_folder``)."""
    placement, replica = _placement(config, layout, device)
    try:
        return _build_pipeline(config, layout, model, device, placement), replica
    except BaseException as e:
        if "mesh" in placement:  # a failure of this rank's alone: its stage's peers hear now
            from pipetrain.runtime.comm.agreement import fail_next_pipeline

            fail_next_pipeline(e, placement["mesh"]["pp"].get_group())
        raise


def _build_pipeline(
    config: TrainConfig,
    layout: Layout,
    model: LayerModel | None,
    device: torch.device,
    placement: dict[str, Any],
) -> Pipeline:
    from datetime import timedelta

    from pipetrain.app import kernels
    from pipetrain.runtime.pipeline import Pipeline

    tp_mesh = placement["mesh"]["tp"] if config.tp > 1 else None
    options: dict[str, Any] = dict(
        device=device,
        timeout=timedelta(seconds=config.timeout),
        defer_weight_grads=_DEFER[config.weight_grads],
        receive_lead=config.receive_lead,
        cuda_graph=config.cuda_graph,
        # every rank compiles at once where the runtime finds it exact (runtime.precompile)
        precompile=None if config.compile else False,
        seed=config.seed,  # dropout keyed by (seed, step, micro-batch, layer): any layout draws alike
        overlap_pairs={"on": True, "off": False}.get(config.pair_overlap, config.ep > 1),
        **placement,
    )
    tied = False  # until the model says (a refusal while loading the folder names no tie)
    try:
        if model is None:
            from pipetrain.app.model_folder import folder_stages
            from pipetrain.hf import causal_lm_token_loss

            stages, tied = folder_stages(config, layout, tp_mesh, device)
            if config.ep > 1:
                stages = _sharding_experts(stages, placement["mesh"])
            pipe = Pipeline(
                stages,
                layout.pipeline_schedule,
                layout.microbatches,
                causal_lm_token_loss,
                stages_per_rank=layout.stages_per_rank,
                num_stages=len(layout.stage_layers),
                offload=layout.offload_spec,  # from_plan's own, for the folder's stages
                **options,
            )
            return pipe
        tied = bool(model.tied)
        if tp_mesh is not None:
            from pipetrain.hf import parallelize_causal_lm

            assert isinstance(model.layers, Mapping)  # Hugging Face models (checked at launch)
            parallelize_causal_lm(
                model.layers,
                tp_mesh,
                sequence_parallel=config.sequence_parallel,
                vocab_parallel=not tied,
            )
        layers = kernels.prepared(model.layers, model.names, config, device)
        pipe = Pipeline.from_plan(layers, layout, loss_fn=model.loss_fn, tied=model.tied, **options)
    except ValueError as e:
        what = "--tie-embeddings" if model is not None else "the folder's tied embeddings"
        flags = f"{what} with --dp {config.dp}: " if tied and config.dp > 1 else ""
        raise Refused(flags + str(e)) from None
    return pipe


def _placement(
    config: TrainConfig, layout: Layout, device: torch.device
) -> tuple[dict[str, Any], int]:
    """``Pipeline``'s placement options (a (pp, dp, tp) mesh when ``--dp`` or ``--tp`` > 1,
    pp-major and tp innermost as in torchtitan and Megatron-Core: a stage's tp ranks are
    consecutive processes, so on one machine's GPUs, and its replicas' FSDP traffic stays near,
    while pipeline neighbours, which send the least, cross machines) and this process's
    data-parallel replica, read from the mesh."""
    if config.dp == 1 and config.tp == 1:
        return {}, 0
    from torch.distributed.device_mesh import init_device_mesh

    sizes = (("pp", layout.ranks), ("dp", config.dp), ("tp", config.tp))
    if config.ep > 1:  # expert parallel borrows from data parallel (runtime.parallel.mesh)
        sizes = (("pp", layout.ranks), ("edp", config.dp // config.ep), ("ep", config.ep))
    dims = [(n, size) for n, size in sizes if size > 1 or n in ("pp", "edp")]
    mesh = init_device_mesh(
        device.type, tuple(size for _, size in dims), mesh_dim_names=tuple(n for n, _ in dims)
    )
    placement: dict[str, Any] = {"mesh": mesh}
    if config.dp == 1:
        return placement, 0
    placement["data_parallel"] = config.data_parallel
    if config.ep > 1:
        return placement, mesh.get_local_rank("edp") * config.ep + mesh.get_local_rank("ep")
    return placement, mesh.get_local_rank("dp")


def _sharding_experts(stages: Any, mesh: Any) -> Any:
    """``stages`` (``stage -> module``) with each built stage's experts sharded over ``mesh``'s
    ``ep`` dimension (``runtime.parallel.expert_parallel``)."""
    from pipetrain.runtime.parallel.expert_parallel import apply_expert_parallel

    def stage(index: int) -> Any:
        module = stages(index)
        apply_expert_parallel(module, mesh["edp", "ep"])
        return module

    return stage


def _local_state(pipe) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers by global name."""
    out = {}
    for s in sorted(pipe.modules):
        out.update(pipe.modules[s].state_dict())
    return out


__all__ = ["MEASURED_STEPS", "NonFinite", "Refused", "Run", "train"]
