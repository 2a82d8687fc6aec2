"""A planned or synthesized program run exactly: one float64 step of ``Pipeline.from_plan`` on the
plan's own layout (its program, placement, cut, recompute and offload) against the unsplit
model's loss and every gradient, for ``plan_nd_gpu.py --mode synthesized``. A benchmark
worker, started by torchrun (NCCL with a GPU per rank, gloo on a CPU):

    torchrun --nproc-per-node 4 benchmarks/planner/plan_program_equivalence.py \\
        --plan synthesized.json --blocks 16 --out equivalence.json

Why a narrow model of the plan's depth: a program's exactness is a property of its order of
actions, transfers and gradient accumulation over the layers it cuts, not of the layers' widths;
the float64 check therefore runs the plan's layer count (embedding, blocks, final norm, head of
a Llama built as ``pipetrain train --model llama`` builds it, tied where the case ties them) at a width where the
unsplit reference fits on rank 0 next to its stages. Passing: the loss and every gradient
within ``TOLERANCE`` (relative, ‖g − g_ref‖ / ‖g_ref‖) of the unsplit model's, and no parameter
missing on either side.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from pipetrain.hf import causal_lm_layers, causal_lm_loss, tied_weights
from pipetrain.planner.layout import Layout
from pipetrain.runtime.pipeline import Pipeline

#: the largest relative error of the loss or of any gradient that passes (issue: 1e-12 in float64)
TOLERANCE = 1e-12
#: rows per micro-batch, tokens per row: small, the check is of the program, not of the widths
ROWS, SEQ, VOCAB = 2, 16, 512


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plan", required=True, help="a plan JSON (`pipetrain synthesize --json`)")
    p.add_argument("--blocks", type=int, required=True, help="the model's transformer blocks")
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--out", required=True, help="the JSON file rank 0 writes")
    return p.parse_args()


def main() -> int:
    args = arguments()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and args.device != "cpu":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", timeout=timedelta(minutes=5), device_id=device)
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    shared = [guarded(lambda: check(args, device))]
    dist.broadcast_object_list(shared, src=0)  # every rank exits with rank 0's verdict
    result = shared[0]
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if result.get("ok") else 1


def build(args: argparse.Namespace) -> tuple[dict, list[tuple[str, ...]]]:
    """The narrow float64 Llama of ``args.blocks`` blocks as layers (name → layer), and its ties
    (``pipetrain train --model llama``'s configuration: MLP 4 × hidden); the same weights on
    every call (seeded)."""
    import transformers as tf

    config = tf.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=128,
        num_hidden_layers=args.blocks,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=args.tie_embeddings,
    )
    torch.manual_seed(7)
    model = tf.LlamaForCausalLM(config).to(torch.float64)
    return dict(causal_lm_layers(model)), [tuple(pair) for pair in tied_weights(model)]


def check(args: argparse.Namespace, device: torch.device) -> dict:
    """One step of the plan on every rank; on rank 0 the errors against the unsplit model."""
    layout = Layout.from_json(json.loads(Path(args.plan).read_text()))
    built, tied = build(args)
    if layout.num_layers != len(built):
        raise ValueError(
            f"the plan cuts {layout.num_layers} layers; --blocks {args.blocks} builds {len(built)}"
        )
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (ROWS * layout.microbatches, SEQ), generator=gen).to(device)
    x = y = tokens  # the Hugging Face loss takes the inputs as labels and shifts them itself
    layers = {k: v.to(device) for k, v in built.items()}
    pipe = Pipeline.from_plan(
        layers,
        layout,
        loss_fn=causal_lm_loss,
        tied=tied,
        device=device,
        timeout=timedelta(minutes=3),
    )
    loss = float(pipe.step(x, y))
    mine = {
        f"{k}": p.grad.detach().cpu()
        for m in pipe.modules.values()
        for k, p in m.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }
    pipe.close()
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() != 0:
        return {}
    return compare(args, device, x, y, loss, everyone)


def compare(args, device, x, y, loss: float, everyone: list[dict]) -> dict:
    """The loss and every gradient of the pipeline against the unsplit model's (rank 0)."""
    grads: dict[str, torch.Tensor] = {}
    for part in everyone:
        for k, g in part.items():  # a tied weight: each end holds the summed gradient
            grads.setdefault(k, g)
    layers = {k: v.to(device) for k, v in build(args)[0].items()}
    h = x
    for layer in layers.values():
        h = layer(h)
    ref_loss = causal_lm_loss(h, y)
    ref_loss.backward()
    want = {
        f"{name}.{k}": p.grad.detach().cpu()
        for name, layer in layers.items()
        for k, p in layer.named_parameters(remove_duplicate=False)
        if p.grad is not None
    }
    missing = sorted(set(want) ^ set(grads))
    worst, where = 0.0, ""
    for k in want.keys() & grads.keys():
        err = (grads[k] - want[k]).norm().item() / (want[k].norm().item() or 1.0)
        if err >= worst:
            worst, where = err, k
    loss_err = abs(loss - ref_loss.item()) / abs(ref_loss.item())
    return {
        "loss": loss,
        "loss_rel_err": loss_err,
        "grad_rel_err": worst,
        "grad_rel_err_at": where,
        "parameters": len(want),
        "missing": missing,
        "tolerance": TOLERANCE,
        "backend": dist.get_backend(),
        "ok": loss_err <= TOLERANCE and worst <= TOLERANCE and not missing,
    }


def guarded(fn) -> dict:
    """``fn()`` on every rank; a failure on any rank is the result's ``error`` on rank 0."""
    try:
        res, err = fn(), None
    except Exception as e:
        res, err = {}, f"{type(e).__name__}: {e}".splitlines()[0][:300]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, err)
    errors = [e for e in everyone if e]
    return {"error": errors[0], "ok": False} if errors else res


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # as plan_gpu.py: no interpreter teardown of torch's process-group threads
