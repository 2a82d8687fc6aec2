"""Pipeline × data parallel on GPUs: a ("dp", "pp") mesh of 2 × 2, FSDP2 and DDP, a Llama model.

    torchrun --standalone --nproc-per-node 4 benchmarks/parallel/gpu_data_parallel.py --out DIR

1. Exactness (float64): one step of a tiny Llama on the mesh against the unsplit model on the
   whole batch, computed on each GPU; the largest relative gradient error over this rank's
   parameters (FSDP2's gathered from the shards) and the loss difference.
2. Training: the same Llama-family model (``--hidden``, ``--layers``) on the generated corpus
   (bytes as tokens), ``--steps`` AdamW steps with FSDP2 on the mesh — float32 next to the same
   model trained on one GPU on the whole batch (the losses should agree to float32 rounding),
   bfloat16 parameters, and bfloat16 compute with float32 master weights (FSDP2's
   ``MixedPrecisionPolicy``) — with step times, tokens/s and peak memory.

Writes ``DIR/data_parallel.json`` (rank 0) and prints a summary. Runs on CPU (gloo) too, with
small sizes, to test the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipetrain.app.models.data import batches, corpus_tensor
from pipetrain.hf import causal_lm_layers, causal_lm_loss
from pipetrain.planner.layout import default_cut
from pipetrain.runtime.layers import split
from pipetrain.runtime.pipeline import Pipeline


def llama(hidden: int, layers: int, heads: int, seq: int, dtype, seed: int = 0):
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=seq,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(config).to(dtype)


def stages_of(model, num_stages: int, layers: int):
    # the embedding before the decoder layers, the final norm and the LM head after them
    return split(causal_lm_layers(model), default_cut(layers, num_stages, first=1, last=2))


def _full(grad):
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def exactness(mesh, device, kind: str, schedule: str) -> dict:
    """One float64 step on the mesh vs the unsplit model on the whole batch."""
    from pipetrain.schedule.registry import family

    num_stages = 2 * family(schedule).default_stages_per_rank
    layers = max(num_stages - 3, 2)
    model = llama(32, layers, 4, 16, torch.float64)
    pipe = Pipeline(
        stages_of(model, num_stages, layers),
        schedule,
        4,
        causal_lm_loss,
        device=device,
        mesh=mesh,
        data_parallel=kind,
        timeout=timedelta(seconds=60),
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (16, 16), generator=g).to(device)
    replica = mesh.get_local_rank("dp")
    mine = ids[replica * 8 : (replica + 1) * 8]
    loss = pipe.step(mine, mine)
    ref = llama(32, layers, 4, 16, torch.float64).to(device)
    ref_loss = causal_lm_loss(ref(ids).logits, ids)
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    local = {id(p) for p in pipe.parameters()}
    worst = 0.0
    for name, p in model.named_parameters():
        if id(p) in local:
            got, want = _full(p.grad), ref_grads[name].grad
            worst = max(worst, float((got - want).norm() / want.norm()))
    return {
        "kind": kind,
        "schedule": schedule,
        "loss_diff": abs(float(loss) - float(ref_loss.detach())),
        "max_rel_grad_err": worst,
    }


def training(mesh, device, args, dtype, mixed: bool, schedule: str) -> dict:
    """``args.steps`` AdamW steps with FSDP2 on the mesh; losses, times, memory."""
    from pipetrain.schedule.registry import family

    num_stages = 2 * family(schedule).default_stages_per_rank
    model = llama(args.hidden, args.layers, args.heads, args.seq, dtype)
    stages = stages_of(model, num_stages, args.layers)
    if mixed:  # float32 master weights, bfloat16 compute, float32 gradient reduction
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        plain = stages

        def stages(s):  # only this rank's stages are asked for
            return fully_shard(plain[s].to(device), mesh=mesh["dp"], mp_policy=policy)

    pipe = Pipeline(
        stages,
        schedule,
        args.microbatches,
        causal_lm_loss,
        device=device,
        mesh=mesh,
        data_parallel="fsdp",
        timeout=timedelta(seconds=120),
        num_stages=num_stages,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=args.lr, betas=(0.9, 0.95))
    local = args.microbatch_size * args.microbatches
    data = batches(corpus_tensor(), 2 * local, args.seq, seed=0)
    replica = mesh.get_local_rank("dp")
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        ids = next(data)[0][replica * local : (replica + 1) * local].to(device)
        _sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = pipe.step(ids, ids)
        opt.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    steady = sorted(times[2:])[len(times[2:]) // 2] if len(times) > 2 else times[-1]
    return {
        "schedule": schedule,
        "dtype": "bf16 compute, fp32 master (FSDP2 MixedPrecisionPolicy)"
        if mixed
        else str(dtype).removeprefix("torch."),
        "losses": losses,
        "median_step_s": steady,
        "tokens_per_s": 2 * local * args.seq / steady,
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30
        if device.type == "cuda"
        else None,
    }


def single_gpu_reference(device, args) -> list[float]:
    """The same float32 training on one device, whole batch, no pipeline."""
    model = llama(args.hidden, args.layers, args.heads, args.seq, torch.float32).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    local = args.microbatch_size * args.microbatches
    data = batches(corpus_tensor(), 2 * local, args.seq, seed=0)
    losses = []
    for _ in range(args.steps):
        ids = next(data)[0].to(device)
        opt.zero_grad(set_to_none=True)
        loss = causal_lm_loss(model(ids).logits, ids)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="out")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here
        torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "pp"))
    result: dict = {"device": torch.cuda.get_device_name(device) if cuda else "cpu"}
    result["torch"] = torch.__version__
    result["args"] = vars(args)

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    exact = []
    for kind, schedule in [
        ("fsdp", "1f1b"),
        ("fsdp", "zbv"),
        ("fsdp", "interleaved-1f1b"),
        ("ddp", "zbv"),
        ("ddp", "dualpipev"),
    ]:
        row = exactness(mesh, device, kind, schedule)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, row)
        row["max_rel_grad_err"] = max(r["max_rel_grad_err"] for r in everyone)
        exact.append(row)
        log(
            f"exact float64 {kind:4} {schedule:16} loss diff {row['loss_diff']:.2e}  "
            f"max rel grad err {row['max_rel_grad_err']:.2e}"
        )
    result["exactness_float64"] = exact
    runs = []
    for dtype, mixed in [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]:
        row = training(mesh, device, args, dtype, mixed, "zbv")
        runs.append(row)
        log(
            f"train {row['dtype']:50} loss {row['losses'][0]:.4f} -> {row['losses'][-1]:.4f}  "
            f"{row['median_step_s'] * 1e3:7.1f} ms/step  {row['tokens_per_s']:,.0f} tok/s  "
            f"peak {row['peak_mem_gib']} GiB"
        )
    result["training_pp2_dp2_fsdp"] = runs
    if rank == 0:
        ref = single_gpu_reference(device, args)
        result["single_device_fp32_losses"] = ref
        worst = max(abs(a - b) / abs(b) for a, b in zip(runs[0]["losses"], ref))
        result["fp32_vs_single_device_max_rel_loss_diff"] = worst
        log(f"float32 pp2×dp2 FSDP2 vs one device, whole batch: max rel loss diff {worst:.2e}")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "data_parallel.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
