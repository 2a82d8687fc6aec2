"""What checking SHA256SUMS adds to resuming a 0.9 B-parameter checkpoint (this folder's README).

A synthetic model of 16 bfloat16 linears of 7680 x 7680 (943.8 M parameters) with AdamW's state
(exp_avg, exp_avg_sq: bfloat16 like the parameters) is written once with
``pipetrain.save_checkpoint`` (one process, DCP without a process group), then loaded back with
``pipetrain.load_checkpoint`` with and without ``verify``, alternating, ``--repeats`` times each;
the hashing alone (``runtime.checksums``) is timed too. Prints one JSON object.

    python docs/results/cpu-2026-12-02-checkpoint-verify/measure.py --dir /tmp/ckpt-0.9b
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

import pipetrain
from pipetrain.runtime import checksums

WIDTH, LAYERS = 7680, 16


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(
        *(torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.bfloat16) for _ in range(LAYERS))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = Path(args.dir) / "step-000001"
    model, opt = build()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW's state exists
    for p in model.parameters():
        p.grad = None
    t0 = time.perf_counter()
    pipetrain.save_checkpoint(path, model, opt)
    save_s = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    times: dict[str, list[float]] = {"load": [], "load_verified": [], "hash_only": []}
    for _ in range(args.repeats):
        for verify in (False, True):
            t0 = time.perf_counter()
            pipetrain.load_checkpoint(path, model, opt, verify=verify)
            times["load_verified" if verify else "load"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        checksums.verify(path)
        times["hash_only"].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    print(
        json.dumps(
            {
                "parameters": sum(p.numel() for p in model.parameters()),
                "checkpoint_bytes": size,
                "save_s": round(save_s, 2),
                "seconds": {k: [round(t, 2) for t in v] for k, v in times.items()},
                "best_s": {k: round(v, 2) for k, v in best.items()},
                "added_fraction": round(best["load_verified"] / best["load"] - 1, 3),
                "hash_gb_per_s": round(size / best["hash_only"] / 1e9, 2),
                "cpu": platform.processor() or platform.machine(),
                "cores": os.cpu_count(),
                "torch": torch.__version__,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
