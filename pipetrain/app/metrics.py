"""``--metrics FILE`` and ``--tensorboard DIR``: one record per step, written by rank 0.

A record holds ``step`` (1-based), ``loss``, ``lr``, ``grad_norm`` (the whole model's, before
any clipping), ``tokens`` (the real tokens of the step's batch, every replica's),
``padding_tokens``, ``tok_per_s`` (real tokens over the step's time plus the time the loop waited
for its batch), ``data_ms`` (that wait: near 0 while ``--prefetch-batches`` keeps ahead),
``mfu``, after an evaluation ``eval_loss``, and where the
model's layers record extra loss terms (a router's balancing loss: ``runtime.extra_losses``)
``aux_loss/<name>`` for each, beside ``loss``, the main loss alone. The metrics
file is JSON Lines, flushed after every line, so a run stopped at any point leaves whole lines;
a resumed run first drops the lines past the step it resumes from (the steps it runs again),
then appends. TensorBoard gets the same scalars (``SummaryWriter``'s ``purge_step`` drops what a
resumed run repeats).

Model FLOPs utilization (MFU, PaLM, Chowdhery et al. 2022, appendix B; nanoGPT's
``estimate_mfu``): the FLOPs a step needs, ``6·N + 12·L·H·T`` per token (N parameters that
take part in matrix products, so not embedding tables looked up; L layers, H hidden size, T
sequence length: the attention scores and their product with the values), times the real tokens
per second, over the dense peak of every GPU of the run. Recomputation is not counted: MFU is
the model's work, not the hardware's. The peaks are for bfloat16 (``PEAK_BF16_FLOPS``, the
datasheets' dense figures); elsewhere (a CPU, another GPU or dtype) the MFU is null rather than
a guess.

The gradient norm comes from ``Pipeline.clip_grad_norm_(inf)`` when not clipping: one more
pass over every gradient and a scalar all-reduce per step (the multiply by 1 it does is exact).

torch is imported inside functions only, so ``pipetrain --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pipetrain.app.config import TrainConfig
    from pipetrain.runtime.pipeline import Pipeline

#: dense bfloat16 peak FLOP/s by a substring of ``torch.cuda.get_device_name()``, the first that
#: matches (NVIDIA datasheets: H200 and H100 SXM 989.4 TFLOPS, H100 PCIe 756, A100 312)
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
)
TENSORBOARD_HINT = "pip install 'pipetrain[data]'"


def check_metrics(config: TrainConfig) -> None:
    """``--tensorboard`` needs the ``tensorboard`` package; ``ValueError`` naming what to
    install."""
    if config.tensorboard is None:
        return
    from importlib.util import find_spec

    if find_spec("tensorboard") is None:
        raise ValueError(f"--tensorboard needs the tensorboard package: {TENSORBOARD_HINT}")


def flops_per_token(parameters: int, layers: int, hidden: int, seq_len: int) -> int:
    """Model FLOPs of one token's forward and backward (see the module docstring)."""
    return 6 * parameters + 12 * layers * hidden * seq_len


def peak_flops(device: torch.device, dtype: str) -> float | None:
    """One GPU's dense peak FLOP/s for ``dtype``, where known (see ``PEAK_BF16_FLOPS``)."""
    if device.type != "cuda" or dtype != "bfloat16":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS if key in name), None)


def matmul_parameters(pipe: Pipeline) -> int:
    """The whole model's parameters outside embedding tables, each counted once: every process
    names its stages' parameters and the names are gathered (collective)."""
    import torch.distributed as dist
    from torch import nn

    mine: dict[str, int] = {}
    for module in pipe.modules.values():
        # a table tied to a head is counted: the head multiplies by it
        used = {
            id(p)
            for m in module.modules()
            if not isinstance(m, nn.Embedding)
            for p in m.parameters(recurse=False)
        }
        for name, p in module.named_parameters():
            if id(p) in used:
                mine[name] = p.numel()  # a DTensor's is the whole tensor's
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return sum({k: v for part in everyone for k, v in part.items()}.values())


class MetricsLog:
    """Rank 0's metrics file and TensorBoard writer (see the module docstring); ``start``: the
    step the run resumes from (0: a new run, whose file is replaced)."""

    def __init__(self, config: TrainConfig, start: int, enabled: bool) -> None:
        self.file: Any = None
        self.board: Any = None
        if not enabled:
            return
        if config.metrics is not None:
            path = Path(config.metrics)
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = _lines_up_to(path, start) if start > 0 else []
            path.write_text("".join(kept))
            self.file = path.open("a")
        if config.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.board = SummaryWriter(config.tensorboard, purge_step=start + 1 if start else None)

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.board is not None:
            step = record["step"]
            for key, value in record.items():
                if key != "step" and value is not None:
                    self.board.add_scalar(key, value, step)
            self.board.flush()

    def close(self) -> None:
        for out in (self.file, self.board):
            if out is not None:
                out.close()


def _lines_up_to(path: Path, step: int) -> list[str]:
    """The whole lines of ``path`` (if it exists) whose step is at most ``step``."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            at = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when a run was stopped
        if at <= step and line.endswith("\n"):
            kept.append(line)
    return kept


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics file (``ValueError`` naming a line that is not one)."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not a JSON line ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{number} has no integer 'step': not a --metrics file")
        records.append(record)
    return records


__all__ = [
    "PEAK_BF16_FLOPS",
    "MetricsLog",
    "check_metrics",
    "flops_per_token",
    "matmul_parameters",
    "peak_flops",
    "read_metrics",
]
