"""What ``pipetrain train --float8`` and ``--compile`` do to each layer, before any stage is built.

As torchtitan does it: ``--float8`` swaps every ``nn.Linear`` of the layers but the LM head for
torchao's float8 training linear (tensorwise scales; the same weight parameters, so names,
checkpoints and exports are unchanged), leaving a linear whose dimensions are not multiples of
16 as it is (the float8 GEMM needs them); on the CPU the float8 casts and rounding are emulated.
``--compile`` then compiles each layer in place. Both run per layer as it is built, so a rank
that builds only its own layers (a layer factory, a model folder's stages) converts only those.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where a layer is prepared (``pipetrain --help`` stays fast)
    import torch
    from torch import nn

    from pipetrain.app.config import TrainConfig


def check(config: TrainConfig) -> None:
    """Refuse what ``--float8`` cannot do here, before any process starts."""
    if not config.float8:
        return
    if config.tp > 1 or config.dp > 1:
        raise ValueError(
            "--float8 with --dp or --tp is not supported yet (float8 linears under tensor "
            "parallel need their own sharding styles); drop --float8 or run --dp 1 --tp 1"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ValueError(f"--float8 needs torchao ({e}): pip install 'pipetrain[float8]'") from None


def prepare(layer: nn.Module, is_head: bool, config: TrainConfig, device: torch.device) -> None:
    """``layer`` converted (``--float8``, unless it is the LM head) and compiled (``--compile``),
    in place."""
    if config.float8 and not is_head:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            layer,
            config=Float8LinearConfig(emulate=device.type != "cuda"),
            module_filter_fn=_float8_able,
        )
    if config.compile:
        layer.compile()


def prepared(layers: Any, names: list[str], config: TrainConfig, device: torch.device) -> Any:
    """``LayerModel.layers`` (name → layer, or a factory index → layer) with ``prepare`` applied
    to each layer, a factory's as it builds them; ``names``: every layer's, in call order (the
    last is the LM head)."""
    if not (config.float8 or config.compile):
        return layers
    if isinstance(layers, Mapping):
        for name, layer in layers.items():
            prepare(layer, name == names[-1], config, device)
        return layers
    factory: Callable[[int], nn.Module] = layers

    def build(index: int) -> nn.Module:
        layer = factory(index)
        prepare(layer, index == len(names) - 1, config, device)
        return layer

    return build


def _float8_able(module: nn.Module, fqn: str) -> bool:
    from torch import nn

    return (
        isinstance(module, nn.Linear)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )
