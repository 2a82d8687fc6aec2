"""Step time with and without the per-step agreement check (runtime/agreement.py), interleaved
blocks on the same pipeline. torchrun --nproc_per_node=2 agree_cost.py OUT.json"""
import json, os, statistics, sys, time
import torch, torch.distributed as dist
from torch import nn
import pipetrain

backend = "nccl" if torch.cuda.is_available() else "gloo"
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if backend == "nccl":
    torch.cuda.set_device(dev)
H = int(os.environ.get("HIDDEN", "2048"))
L = int(os.environ.get("LAYERS", "4"))
results = {}
for schedule, per_rank in (("1f1b", 1), ("zb-h1", 1), ("zbv", 2)):
    torch.manual_seed(0)
    stages = [nn.Sequential(*[m for _ in range(L) for m in (nn.Linear(H, H), nn.GELU())]) for _ in range(world * per_rank)]
    pipe = pipetrain.Pipeline(stages, schedule, 8, nn.functional.mse_loss, device=dev)
    x = torch.randn(64, 128, H, device=dev)
    y = torch.randn(64, 128, H, device=dev)
    check = pipe.agreement.step
    times = {"with": [], "without": []}
    for _ in range(3):
        pipe.step(x, y)
    for block in range(10):
        for variant in ("with", "without") if block % 2 == 0 else ("without", "with"):
            pipe.agreement.step = check if variant == "with" else (lambda *a, **k: None)
            for _ in range(3):
                if backend == "nccl":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                pipe.step(x, y)
                if backend == "nccl":
                    torch.cuda.synchronize()
                times[variant].append((time.perf_counter() - t0) * 1e3)
                for p in pipe.parameters():
                    p.grad = None
    pipe.agreement.step = check
    t0 = time.perf_counter(); pipe.agreement.step("train", pipe._split(x, y).inputs, pipe._split(x, y).targets, 64); t1 = time.perf_counter()
    row = {v: {"median_ms": statistics.median(t), "stdev_ms": statistics.stdev(t), "n": len(t)} for v, t in times.items()}
    row["check_call_ms_known_shapes"] = (t1 - t0) * 1e3
    results[schedule] = row
    pipe.close()
    if rank == 0:
        print(schedule, json.dumps(row), flush=True)
if rank == 0 and len(sys.argv) > 1:
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(0) if backend == "nccl" else "cpu", "hidden": H, "layers_per_stage": L, "batch": [64, 128, H], "microbatches": 8, "ranks": world, "date": time.strftime("%Y-%m-%d")}
    json.dump({"setup": info, "results": results}, open(sys.argv[1], "w"), indent=1)
dist.destroy_process_group()
