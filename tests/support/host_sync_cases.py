"""What a step's actions read back from the device: nothing, for the models pipetrain ships
layers of. A read (``.item()``, ``bool(tensor)``, a data-dependent shape) inside an action stalls
the host once per micro-batch — it cannot queue the next action while the device catches up —
and inside a captured step (``cuda_graph=True``) it fails the capture. On CPU the reads are
seen at the dispatcher (``aten._local_scalar_dense`` and kin), attributed by the Python stack
to the executor's actions or to the step's host-side bookkeeping around them."""

from __future__ import annotations

import traceback

import torch
from hf_cases import ROWS, batch, build
from torch.utils._python_dispatch import TorchDispatchMode

#: operators whose result the host must wait for
READS = {"_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique"}


class HostReads(TorchDispatchMode):
    """Records each device read made from inside the executor's actions, with where it was."""

    def __init__(self) -> None:
        super().__init__()
        self.inside_actions: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in READS:
            stack = traceback.extract_stack()
            if any(f.filename.endswith("runtime/executor.py") for f in stack):
                mine = [f for f in stack if "torch/" not in f.filename][-4:-1]  # not this file
                where = " <- ".join(
                    f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in mine[::-1]
                )
                self.inside_actions.append(f"{func.overloadpacket.__name__} at {where}")
        return func(*args, **(kwargs or {}))


def reads_inside_actions(rank: int, world: int, kinds: list[str]) -> list[str]:
    """Two steps of each ``kind`` (``pipetrain.hf`` layers, zbv, 2 stages on this one rank,
    ``causal_lm_loss``) and of the app's GPT; every device read inside an action, named."""
    import pipetrain
    from pipetrain.hf import causal_lm_layers, causal_lm_loss

    found = []
    ids = batch()
    for kind in kinds:
        layers = list(causal_lm_layers(build(kind)).values())
        stages = pipetrain.split(layers, [2, len(layers) - 2])
        with pipetrain.Pipeline(stages, "zbv", 2, causal_lm_loss, stages_per_rank=2) as pipe:
            reads = HostReads()
            with reads:
                for _ in range(2):
                    pipe.step(ids, ids)
        found += [f"{kind}: {r}" for r in reads.inside_actions]
    found += _gpt_reads()
    return found


def _gpt_reads() -> list[str]:
    import pipetrain
    from pipetrain.app.models.gpt import GPTConfig, gpt_layer, gpt_layer_names, lm_loss

    cfg = GPTConfig(vocab_size=61, seq_len=8, num_layers=2, hidden=16, num_heads=2)
    layers = [gpt_layer(cfg, i, 0).double() for i in range(len(gpt_layer_names(cfg)))]
    stages = pipetrain.split(layers, [2, len(layers) - 2])
    ids = torch.randint(0, 61, (ROWS - 1, 9))
    with pipetrain.Pipeline(stages, "zbv", 2, lm_loss, stages_per_rank=2) as pipe:
        reads = HostReads()
        with reads:
            for _ in range(2):
                pipe.step(ids[:, :-1], ids[:, 1:])
    return [f"gpt: {r}" for r in reads.inside_actions]
