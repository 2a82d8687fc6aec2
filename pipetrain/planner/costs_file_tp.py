"""The costs file's tensor-parallel entries (version 3): what one layer costs each rank of a
tensor-parallel group of ``degree`` ranks, and how such an entry is derived where no group of
that size could be measured.

Per layer, ``"tp"`` is a list of entries, one per degree::

    "tp": [{"degree": 2, "source": "derived", "forward": 0.6, "backward_input": 0.6,
            "backward_weight": 0.5, "backward": 1.1, "forward_collective": 0.05,
            "backward_collective": 0.05, "activation": 0.3, "params": 2.1, "gradients": 0.5}]

Times are ms per micro-batch on each rank of the group: the compute pieces without the group's
collectives, which ``forward_collective`` (the all-reduces and all-gathers the forward waits
for) and ``backward_collective`` (the backward's, paid in its input half) give apart, so a
reader sees what tensor parallel costs in communication. Memory is GiB per rank. ``source``
says whether the entry was ``measured`` on a group of that size (``pipetrain profile --tp``
where the machine runs the degree: the split layer timed on every rank, the collectives it
issues replayed alone and taken out of its compute; ``runtime.profile.profile_tp_measured``) or
``derived`` from the layer's degree-1 numbers (``derive``); both read alike, and the file's
``meta["tp"]`` lists the degrees of each. Degree 1 is the layer's own fields; an entry of
degree 1 is refused (one place for one number).

The derivation follows Megatron-LM's split of a transformer layer (Shoeybi et al., 2019;
Korthikanti et al., 2022, for the activations), measured once at degree 1 (``TpShape``): the
layer's matrix products, timed alone, run ``1/t`` of their work on each rank and the rest of the
layer (norms, element-wise ops, the attention's softmax is split with the heads and counted with
the products) runs whole; each parallel region (a column-split product followed by a row-split
one) all-reduces its output in the forward and its input gradient in the backward, a ring
all-reduce sending ``2(t-1)/t`` of the bytes over the link; a head split by vocabulary gathers
its logits (``(t-1)/t``); parameters in split matrices and the saved tensors narrower or wider
than the hidden size (heads, MLP features) are ``1/t`` per rank, the rest (norms, the residual
stream, inputs of column-split products) whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: where an entry came from
SOURCES = ("measured", "derived")
#: the entry's numbers, in the order the file gives them
TP_NUMBERS = (
    "forward",
    "backward_input",
    "backward_weight",
    "backward",
    "forward_collective",
    "backward_collective",
    "activation",
    "params",
)
TP_KEYS = ("degree", "source", *TP_NUMBERS, "gradients")


@dataclass(frozen=True, kw_only=True)
class TpCost:
    """One layer on each rank of a tensor-parallel group of ``degree`` ranks (ms; GiB)."""

    degree: int
    source: str
    forward: float
    backward_input: float
    backward_weight: float
    backward: float
    forward_collective: float
    backward_collective: float
    activation: float
    params: float
    #: GiB of this rank's gradients (what data parallel reduces); ``None``: not given
    gradients: float | None = None

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"degree": self.degree, "source": self.source}
        out |= {k: getattr(self, k) for k in TP_NUMBERS}
        if self.gradients is not None:
            out["gradients"] = self.gradients
        return out


@dataclass(frozen=True)
class TpShape:
    """What the derivation needs of one layer, measured at degree 1."""

    #: ms of the layer's forward spent in its matrix products (timed alone); the input and the
    #: weight halves of the backward each take as long
    gemm_forward: float
    #: share of the layer's parameter bytes in matrices tensor parallel splits
    split_params: float
    #: share of the bytes its forward saves that tensor parallel splits (heads, MLP features)
    split_activation: float
    #: bytes all-reduced per micro-batch in the forward, and in the backward
    forward_all_reduce: float
    backward_all_reduce: float
    #: bytes all-gathered per micro-batch in the forward (a vocabulary-split head's logits)
    forward_all_gather: float = 0.0


def all_reduce_ms(nbytes: float, degree: int, link_gbs: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``degree`` ranks: each sends ``2(t-1)/t`` of them."""
    return 2 * (degree - 1) / degree * nbytes / (link_gbs * 1e9) * 1e3 if degree > 1 else 0.0


def all_gather_ms(nbytes: float, degree: int, link_gbs: float) -> float:
    """A ring all-gather whose result is ``nbytes``: each rank sends ``(t-1)/t`` of them."""
    return (degree - 1) / degree * nbytes / (link_gbs * 1e9) * 1e3 if degree > 1 else 0.0


def derive(
    degree: int,
    *,
    forward: float,
    backward_input: float,
    backward_weight: float,
    activation: float,
    params: float,
    gradients: float | None,
    shape: TpShape,
    link_gbs: float,
) -> TpCost:
    """The layer at ``degree`` from its degree-1 numbers and ``shape`` (the module docstring's
    model); ``link_gbs``: GB/s each rank sends at within the group."""
    if degree < 2:
        raise ValueError(f"a derived tensor-parallel degree must be >= 2, got {degree}")
    if not link_gbs > 0:
        raise ValueError(f"--link-gbs must be > 0, got {link_gbs}")

    def split(total: float, part: float) -> float:
        part = min(max(part, 0.0), total)
        return total - part + part / degree

    gemm = shape.gemm_forward
    f = split(forward, gemm)
    i, w = split(backward_input, gemm), split(backward_weight, gemm)
    gathered = all_gather_ms(shape.forward_all_gather, degree, link_gbs)
    return TpCost(
        degree=degree,
        source="derived",
        forward=f,
        backward_input=i,
        backward_weight=w,
        backward=i + w,
        forward_collective=all_reduce_ms(shape.forward_all_reduce, degree, link_gbs) + gathered,
        backward_collective=all_reduce_ms(shape.backward_all_reduce, degree, link_gbs),
        activation=split(activation, activation * shape.split_activation),
        params=split(params, params * shape.split_params),
        gradients=None if gradients is None else split(gradients, gradients * shape.split_params),
    )


def parse_tp(raw: object, where: str, fail: Callable[[str, str], ValueError]) -> tuple[TpCost, ...]:
    """A layer's ``"tp"`` list, checked: a ``ValueError`` from ``fail`` names the bad field."""
    if not isinstance(raw, list):
        raise fail(where, f"expected a list of tensor-parallel entries, got {raw!r}")
    entries: list[TpCost] = []
    for n, item in enumerate(raw):
        at = f"{where}[{n}]"
        if not isinstance(item, Mapping):
            raise fail(at, f"expected a JSON object, got {type(item).__name__}")
        unknown = sorted(set(item) - set(TP_KEYS))
        if unknown:
            raise fail(f"{at}.{unknown[0]}", f"unknown field; legal fields: {', '.join(TP_KEYS)}")
        degree = item.get("degree")
        if not isinstance(degree, int) or isinstance(degree, bool) or degree < 2:
            raise fail(
                f"{at}.degree", f"expected an integer >= 2 (1 is the layer's own), got {degree!r}"
            )
        if any(e.degree == degree for e in entries):
            raise fail(f"{at}.degree", f"degree {degree} given twice")
        source = item.get("source")
        if source not in SOURCES:
            raise fail(f"{at}.source", f"expected one of {', '.join(SOURCES)}, got {source!r}")
        numbers = {}
        for key in TP_NUMBERS:
            if key not in item:
                raise fail(f"{at}.{key}", "missing")
            numbers[key] = _number(item[key], f"{at}.{key}", fail)
        grads = item.get("gradients")
        entries.append(
            TpCost(
                degree=degree,
                source=source,
                **numbers,
                gradients=None if grads is None else _number(grads, f"{at}.gradients", fail),
            )
        )
    return tuple(sorted(entries, key=lambda e: e.degree))


def _number(value: object, where: str, fail: Callable[[str, str], ValueError]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e12:
        raise fail(where, f"expected a finite number >= 0, got {value!r}")
    return float(value)
