"""A rank failing mid-run on NCCL: how long until every rank has stopped, and with what.

One 2-rank job (``torchrun --nproc-per-node 2``), a small pipeline of linears, ``--schedule``
with 8 micro-batches; at step ``--fail-step`` rank ``--fail-rank``'s stage raises in the forward of
micro-batch 3 (step 0 is the first step, whose transfers are preceded by shape messages the host
waits for; later steps only queue work on the GPU). Each rank writes, as soon as its step raised,
``failure-rank<r>.json`` under ``--out``: the exception's type and first line and the seconds
from the start of the failing step to the exception; then it lets the exception go uncaught, so
the interpreter's exit path runs as a failing job's would. The caller times the whole launch.
Under ``torchrun`` the agent kills the other ranks once one exits with an error, so what this
measures is the launch without such an agent — two plain processes, as a launcher that leaves
peers running would have them (``--stack-dump-s`` prints where a rank that does not stop waits):

    export MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 WORLD_SIZE=2
    for r in 0 1; do RANK=$r LOCAL_RANK=$r timeout 40 python3 benchmarks/runtime/failure_gpu.py \
      --fail-step 3 --pg-timeout-s 30 --stack-dump-s 12 --out $OUT > $OUT/log$r.txt 2>&1 & done
    wait
"""

from __future__ import annotations

import argparse
import atexit
import faulthandler
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

import pipetrain


class Failing(nn.Module):
    """A stage of linears that, once ``armed`` on the failing rank, raises in its fourth forward."""

    def __init__(self, width: int, fail: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
        self.fail, self.calls, self.armed = fail, 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and self.fail:
            self.calls += 1
            if self.calls == 4:
                raise RuntimeError("injected failure in a stage's forward")
        return self.body(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--fail-step", type=int, default=0)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--pg-timeout-s", type=float, default=90.0)
    parser.add_argument("--stack-dump-s", type=float, default=0.0, help="0: off")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    timeout = timedelta(seconds=args.pg_timeout_s)
    if args.stack_dump_s:  # where a rank that does not stop is waiting
        faulthandler.dump_traceback_later(args.stack_dump_s, repeat=True)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    width, spr = 1024, 2 if args.schedule in ("zbv", "dualpipev", "interleaved-1f1b") else 1
    stages = [Failing(width, rank == args.fail_rank) for _ in range(2 * spr)]
    pipe = pipetrain.Pipeline(
        stages, args.schedule, 8, nn.functional.mse_loss, device=device, timeout=timeout
    )
    if args.stack_dump_s:  # registered after the pipeline's exit hook, so it runs first
        atexit.register(faulthandler.dump_traceback_later, args.stack_dump_s, repeat=True)
    x, y = torch.randn(64, width, device=device), torch.randn(64, width, device=device)
    for step in range(args.fail_step + 2):
        for stage in stages:
            stage.armed = step == args.fail_step
        start = time.monotonic()
        try:
            loss = pipe.step(x, y)
            if loss is not None:
                float(loss)
        except BaseException as e:
            seconds = time.monotonic() - start
            record = {
                "rank": rank,
                "schedule": args.schedule,
                "fail_step": args.fail_step,
                "step": step,
                "error": type(e).__name__,
                "message": str(e).splitlines()[0][:300],
                "seconds_to_error": round(seconds, 3),
            }
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"failure-rank{rank}.json").write_text(json.dumps(record))
            print(json.dumps(record), flush=True)
            raise
        print(f"rank {rank}: step {step} done", flush=True)
    print(f"rank {rank}: no failure reached", flush=True)


if __name__ == "__main__":
    main()
