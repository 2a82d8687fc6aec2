"""Train a Hugging Face Llama-family model on a text file: pipeline × data parallel, from flags.

    python -m pipetrain.app.hf_train --ranks 2 --dp 2 --data-parallel fsdp --steps 60

The model is built from a ``transformers`` config (tiny by default, random weights: nothing is
downloaded), its layers come from ``pipetrain.hf.causal_lm_layers`` and are cut into stages with
the embedding on the first and the final norm and head on the last. Tokens are the bytes of a text
file (``--text``; by default the corpus ``app.models.data`` generates, written to ``--corpus-out``
first), so the vocabulary is 256 and no tokenizer is needed. ``--ranks`` pipeline ranks times
``--dp`` data-parallel replicas processes are launched through torchrun (gloo on CPU, NCCL with a
GPU per process); each replica steps on its share of the global batch. Rank 0 shows a progress bar
(loss, tokens/s) and ends with ``app.train``'s report: the measured step next to the simulator's
prediction from the measured action times, drawn.

Not here yet (they depend on pipetrain pieces being built in parallel): gradient clipping over
the pipeline, checkpoints and ``--resume``, tied embeddings (the models are built untied).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pipetrain.schedule.registry import FAMILIES, build_schedule, family

if TYPE_CHECKING:
    import torch
    from torch import nn

MODELS = ("llama", "qwen3", "mistral")
BYTE_VOCAB = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    runnable = ", ".join(f.name for f in FAMILIES.values() if f.runnable)
    add = parser.add_argument
    add("--model", default="llama", choices=MODELS, help="model family (default llama)")
    add("--schedule", "-s", default="1f1b", help=f"schedule: {runnable} (default 1f1b)")
    add("--ranks", "-p", type=int, default=2, help="pipeline ranks (default 2)")
    add("--dp", type=int, default=2, help="data-parallel replicas (default 2)")
    add("--data-parallel", default="fsdp", choices=("ddp", "fsdp"), help="(default fsdp)")
    add("--stages-per-rank", "-v", type=int, default=None, help="(default: the schedule's)")
    add("--microbatches", "-m", type=int, default=4, help="micro-batches per step (default 4)")
    add("--microbatch-size", type=int, default=4, help="sequences per micro-batch (default 4)")
    add("--steps", type=int, default=60, help="optimizer steps (default 60)")
    add("--layers", type=int, default=4, help="decoder layers (default 4)")
    add("--hidden", type=int, default=64, help="hidden size (default 64)")
    add("--heads", type=int, default=4, help="attention heads (default 4)")
    add("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    add("--seq-len", type=int, default=64, help="tokens (bytes) per sequence (default 64)")
    add("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    add("--seed", type=int, default=0, help="seed for the weights and batches (default 0)")
    add("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    add("--text", default=None, help="a text file to train on (default: the generated corpus)")
    add("--corpus-out", default="out/corpus.txt", help="where the generated corpus is written")
    add("--device", default="auto", choices=("auto", "cpu", "cuda"))
    add("--svg", default="out/hf_train_step.svg", help="the measured step as SVG")
    add("--timeout", type=float, default=300.0, help="seconds a rank waits on a peer")
    add("--worker", action="store_true", help=argparse.SUPPRESS)


def check_arguments(args: argparse.Namespace) -> int:
    """Everything checkable without a process; returns the stage count (``ValueError`` else)."""
    for name in ("ranks", "dp", "microbatches", "microbatch_size", "steps", "layers", "hidden"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not family(args.schedule).runnable:
        raise ValueError(f"{args.schedule} holds two copies of the model; pick another schedule")
    program = build_schedule(args.schedule, args.ranks, args.microbatches, args.stages_per_rank)
    if args.layers + 3 < program.num_stages:
        raise ValueError(
            f"--layers {args.layers} gives {args.layers + 3} layers (with the embedding, norm and "
            f"head) for {program.num_stages} stages; use --layers >= {program.num_stages - 3}"
        )
    if args.hidden % args.heads or args.heads % args.kv_heads:
        raise ValueError(
            f"--hidden {args.hidden} must be a multiple of --heads {args.heads}, and --heads of "
            f"--kv-heads {args.kv_heads}"
        )
    if args.text is not None and not Path(args.text).is_file():
        raise ValueError(f"--text {args.text}: no such file")
    return program.num_stages


def run(args: argparse.Namespace) -> int:
    """Launch the workers (outside torchrun) or be one; the exit status."""
    try:
        check_arguments(args)
        device = _device_kind(args)
    except ValueError as e:
        print(f"hf_train: error: {e}", file=sys.stderr)
        return 2
    if args.worker:
        return _worker(args, device)
    processes = args.ranks * args.dp
    argv = [a for a in sys.argv[1:] if a != "--worker"] if args.argv is None else args.argv
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(processes), "-m", "pipetrain.app.hf_train", *argv]
    cmd += ["--device", device, "--worker"]
    print(f"launching {processes} processes: {args.ranks} pipeline × {args.dp} data parallel")
    sys.stdout.flush()
    return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _device_kind(args: argparse.Namespace) -> str:
    import torch

    need, gpus = args.ranks * args.dp, torch.cuda.device_count()
    if args.device == "cuda" and gpus < need:
        raise ValueError(f"--device cuda needs {need} GPUs (one per process); found {gpus}")
    if args.device == "auto":
        return "cuda" if gpus >= need else "cpu"
    return args.device


def stage_layer_counts(num_blocks: int, num_stages: int) -> list[int]:
    """Layers per stage: decoder blocks spread evenly (earlier stages get the remainder), the
    embedding added to the first stage, the final norm and head to the last."""
    total = num_blocks + 3
    if num_stages > total:
        raise ValueError(f"{num_stages} stages for {total} layers")
    base, extra = divmod(num_blocks, num_stages)
    counts = [base + (s < extra) for s in range(num_stages)]
    counts[0] += 1
    counts[-1] += 2
    # a stage left with no layer (more stages than blocks) borrows from its fuller neighbour
    for s in range(num_stages):
        if counts[s] == 0:
            donor = max(range(num_stages), key=lambda i: counts[i])
            counts[donor] -= 1
            counts[s] += 1
    return counts


def cut(layers: list[nn.Module], counts: list[int]) -> list[nn.Module]:
    from torch import nn

    stages, start = [], 0
    for n in counts:
        stages.append(nn.Sequential(*layers[start : start + n]))
        start += n
    return stages


def build_model(args: argparse.Namespace) -> nn.Module:
    import torch
    import transformers as tf

    common = dict(
        vocab_size=BYTE_VOCAB,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    if args.model == "llama":
        config, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif args.model == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=args.hidden // args.heads)
        cls = tf.Qwen3ForCausalLM
    else:
        config, cls = tf.MistralConfig(**common, sliding_window=None), tf.MistralForCausalLM
    torch.manual_seed(args.seed)
    return cls(config).to(getattr(torch, args.dtype))


def read_tokens(args: argparse.Namespace) -> torch.Tensor:
    """The text file's bytes as token ids (the generated corpus, written first, by default)."""
    import torch

    path = Path(args.text) if args.text is not None else Path(args.corpus_out)
    if args.text is None and not path.is_file():
        from pipetrain.app.models.data import make_corpus

        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # several ranks may write at once
        tmp.write_bytes(make_corpus())
        tmp.replace(path)
    return torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8).long()


def _worker(args: argparse.Namespace, device_kind: str) -> int:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_kind == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout)
    )
    try:
        status = train(args, device)
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, device: torch.device) -> int:
    """One worker's training loop (inside an initialised process group of ranks × dp)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pipetrain.app.models.data import batches
    from pipetrain.app.train import MEASURED_STEPS, _Progress, report
    from pipetrain.hf import causal_lm_layers, causal_lm_loss
    from pipetrain.runtime.pipeline import Pipeline

    num_stages = check_arguments(args)
    rank = dist.get_rank()
    model = build_model(args)
    layers = list(causal_lm_layers(model).values())
    stages = cut(layers, stage_layer_counts(args.layers, num_stages))
    placement: dict = {"group": None}
    replica = 0
    if args.dp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.dp, args.ranks), mesh_dim_names=("dp", "pp"))
        placement = {"mesh": mesh, "data_parallel": args.data_parallel}
        replica = mesh.get_local_rank("dp")
    pipe = Pipeline(
        stages,
        args.schedule,
        args.microbatches,
        causal_lm_loss,
        stages_per_rank=args.stages_per_rank,
        device=device,
        timeout=timedelta(seconds=args.timeout),
        **placement,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95))
    local = args.microbatch_size * args.microbatches
    data = batches(read_tokens(args), local * args.dp, args.seq_len, args.seed)
    mine = slice(replica * local, (replica + 1) * local)
    bar = _Progress(args.steps, enabled=rank == 0)
    losses, measured = [], []
    for step in range(args.steps):
        ids = next(data)[0][mine].to(device)
        timed = step >= args.steps - MEASURED_STEPS
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(ids, ids, timeline=timed)
        opt.step()
        losses.append(float(loss))
        bar.update(step + 1, losses[-1], ids.numel() * args.dp / (time.perf_counter() - t0))
        if timed and pipe.last_timeline is not None:
            measured.append(pipe.last_timeline)
    bar.close()
    if rank == 0:
        print(report(args, losses, measured, pipe.program, shared_cores=device.type == "cpu"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipetrain.app.hf_train")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = argv
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
