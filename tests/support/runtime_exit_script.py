"""The README's example, shaped as a user's script (run by test_runtime_exit.py, one process per
rank, env:// rendezvous): build, train a few steps, measure one, exit, by the variant in argv[1]:
``plain`` (no close, no destroy_process_group), ``with`` (context manager), ``destroy``
(destroy_process_group at the end), ``refused`` (then a load of a shallower model's checkpoint,
written to the folder in argv[2], which every rank refuses; caught, then exit).

With ``PIPETRAIN_EXIT_PROBE`` set, rank 0 says on stderr, from the last exit handler Python runs
(registered first), whether the rendezvous store's server still accepts connections: one left
for the interpreter's own teardown is freed among C++ static objects, where it aborted now and
then."""

import atexit
import os
import socket
import sys


def _probe_store_server() -> None:
    with socket.socket() as s:
        up = s.connect_ex((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))) == 0
    print(f"store server at exit: {'up' if up else 'gone'}", file=sys.stderr, flush=True)


if os.environ.get("PIPETRAIN_EXIT_PROBE") and os.environ["RANK"] == "0":
    atexit.register(_probe_store_server)  # before torch: its exit handlers run before this one

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import pipetrain  # noqa: E402

torch.set_num_threads(1)
variant = sys.argv[1]
schedule = os.environ.get("PIPETRAIN_SCHEDULE", "zb-h1")
dist.init_process_group("gloo")
per_rank = 2 if schedule in ("zbv", "interleaved-1f1b") else 1
torch.manual_seed(0)
stages = [
    nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    for _ in range(dist.get_world_size() * per_rank)
]
x, y = torch.randn(16, 16), torch.randn(16, 16)


def train(pipe):
    for _ in range(3):
        pipe.step(x, y)
        with torch.no_grad():
            for p in pipe.parameters():
                p -= 0.01 * p.grad
                p.grad = None
    pipe.step(x, y, timeline=True)
    return pipe.last_timeline.bubble_fraction


args = (stages, schedule, 8, nn.functional.mse_loss)
if variant == "with":
    with pipetrain.Pipeline(*args) as pipe:
        train(pipe)
else:
    pipe = pipetrain.Pipeline(*args)
    train(pipe)
    if variant == "destroy":
        dist.destroy_process_group()
    if variant == "refused":
        shallow = [nn.Linear(16, 16) for _ in stages]
        pipetrain.save_checkpoint(sys.argv[2], pipetrain.Pipeline(shallow, *args[1:]))
        try:
            pipetrain.load_checkpoint(sys.argv[2], pipe)
            sys.exit("the load was not refused")
        except (KeyError, ValueError):
            pass
