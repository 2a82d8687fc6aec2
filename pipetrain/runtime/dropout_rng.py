"""Dropout that draws the same masks on every layout: each layer's forward for a micro-batch runs
on a generator seeded by a key, not on torch's global stream in whatever order a schedule runs.

Why. Dropout modules read torch's default generator. A pipeline runs micro-batches through its
stages in its schedule's order (1F1B, ZBV and DualPipeV each their own), resumes mid-run and
recomputes forwards, so the global stream hands a layer a different mask on every layout, after
every resume and on every replica count. Keying each draw by *what* is drawn — (seed, step,
global micro-batch, the layer's global name) — rather than *when* makes the masks a property
of the model and the data: every schedule, every cut, a resumed run and the unsplit model run
under the same keys (``DropoutKeys.attach`` and ``running``) draw the same ones.

How. Around each compute action, ``running`` forks the generators (``torch.random.fork_rng``,
so the caller's stream is left as found) and a forward pre-hook on every layer seeds them
with the layer's key: the layer's dropouts, however many and wherever inside it (an
``nn.Dropout``, ``scaled_dot_product_attention``'s ``dropout_p``), draw from that stream in
the layer's own order. Recompute replays them: a checkpointed layer's hook runs before
``torch.utils.checkpoint`` saves the state it restores, and a stage recomputed as a whole
(``backward.whole_stage_recompute``) runs its layers again inside ``running`` for the same
micro-batch, so each layer is seeded with the same key. The key is blake2b of its parts (never
Python's ``hash``, which differs per process); the global name is what ``pipetrain.split``
registers the layer under (``layers.<index>`` by default), known on every rank without
knowing the other stages' cuts. A stage that is not a ``Stage`` of layers is one layer, named
``stages.<index>``.

Data parallel: replica ``r``'s local micro-batch ``j`` is global micro-batch ``r·M + j``, as in
the unsplit model over the whole batch. Tensor parallel follows Megatron-LM's
``CudaRNGStatesTracker`` (``megatron/core/tensor_parallel/random.py``): a draw on a replicated
activation uses a stream every tp rank shares (a tp rank in its key would make replicated
tensors silently diverge), a draw on a sharded one a stream of its own rank's. The layer's
stream has no tp rank; a module whose dropout is a float it passes to an attention kernel
(``attention_dropout``: the Llama family's, on heads split over the tp ranks) and that holds
a tp-sharded parameter draws inside a fork seeded with the tp rank too, so the layer's stream
after it is the same on every tp rank. That attention dropout then equals no unsplit run (each
rank draws for its own heads); everything else is exact against the unsplit model. An
``nn.Dropout`` module is taken to act on a replicated activation (the tp plans here have none on
a sharded one); on a sequence-parallel shard it would draw the same pattern on every shard.

Cost: where no module has dropout active (``p > 0`` and in training mode, checked per action
over the sites ``attach`` found once), ``running`` and the hooks do nothing. A captured CUDA
graph cannot re-seed a generator between kernels: refused (``refuse_captured``).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipetrain.runtime.backward.activation_checkpoint import Recomputed
from pipetrain.runtime.named_layers import Stage

#: attributes through which a module passes its dropout probability to a kernel as a float
FLOAT_DROPOUTS = ("attention_dropout", "dropout", "attn_dropout", "dropout_p")


def layer_seed(
    seed: int, step: int, microbatch: int, layer: str, tp_rank: int | None = None
) -> int:
    """The generator seed of ``layer`` (its global name) for global micro-batch ``microbatch``
    of step ``step``; ``tp_rank``: a sharded activation's stream (module docstring)."""
    text = f"{seed}/{step}/{microbatch}/{layer}" + ("" if tp_rank is None else f"/tp{tp_rank}")
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63: any generator takes it


@dataclass(frozen=True)
class Site:
    """A module that draws dropout: an ``nn.Dropout``-family module (``attribute`` None: its
    ``p``) or one passing the float ``attribute`` to a kernel."""

    module: nn.Module
    attribute: str | None = None

    def probability(self) -> float:
        p = getattr(self.module, self.attribute or "p", 0.0)
        return float(p) if isinstance(p, (int, float)) else 0.0

    def active(self) -> bool:
        return self.module.training and self.probability() > 0


def find_sites(module: nn.Module) -> list[Site]:
    """Every dropout site in ``module`` (``Site``)."""
    sites = []
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            sites.append(Site(m))
            continue
        for name in FLOAT_DROPOUTS:
            if isinstance(getattr(m, name, None), float):
                sites.append(Site(m, name))
                break
    return sites


def _tp_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds a parameter sharded over some mesh (a ``DTensor`` with a
    ``Shard`` placement): its activations between its projections are split too."""
    from torch.distributed.tensor import DTensor

    return any(
        isinstance(p, DTensor) and any(pl.is_shard() for pl in p.placements)
        for p in module.parameters()
    )


def _unwrapped(layer: nn.Module) -> nn.Module:
    """The layer as given, under pipetrain's recompute wrapper or ``torch.compile``'s: the one a
    reference attaches to, so sites are named alike."""
    while True:
        inner = layer.layer if isinstance(layer, Recomputed) else getattr(layer, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return layer
        layer = inner


class DropoutKeys:
    """Keyed dropout streams for some layers (module docstring).

    ``seed``: None draws from torch's global generator as before (nothing is attached).
    ``device``: where the layers run (its generator is seeded beside the CPU's). ``step``: the
    training step the next draws belong to (``Pipeline.step`` counts it; a resumed run sets the
    step it resumes at). ``microbatch_offset``: the global index of local micro-batch 0 (data
    parallel: replica × micro-batches). ``tp_rank``: this rank's tensor-parallel rank, or None.

    A reference loop runs the unsplit model as a pipeline draws::

        keys = DropoutKeys(seed=7).attach(layers)      # names layers.<i>, as split gives
        for j, x in enumerate(micro_batches):
            with keys.running(j):                       # forward (and a recomputing backward)
                loss_j = loss_fn(model(x), y[j])
        keys.step += 1
    """

    def __init__(
        self,
        seed: int | None,
        device: torch.device | str = "cpu",
        *,
        step: int = 0,
        microbatch_offset: int = 0,
        tp_rank: int | None = None,
    ) -> None:
        self.seed, self.step, self.device = seed, step, torch.device(device)
        self.microbatch_offset, self.tp_rank = microbatch_offset, tp_rank
        self.sites: list[Site] = []
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        #: the global micro-batch being run (inside ``running``), else None: hooks do nothing
        self.microbatch: int | None = None
        self._forks: list[contextlib.ExitStack] = []

    def attach(
        self, layers: Sequence[nn.Module] | Mapping[str, nn.Module] | nn.Module, names=None
    ) -> DropoutKeys:
        """Key ``layers``: a ``Stage`` (its layers under their global names), a mapping name →
        layer, or a sequence of layers named ``names`` (default ``layers.<index>``, as
        ``pipetrain.split`` names them). Returns ``self``; ``detach`` removes the hooks."""
        if self.seed is None:
            return self
        if isinstance(layers, Stage):
            named = list(zip(layers.layer_names, (entry for entry, _ in layers.chain)))
        elif isinstance(layers, (Mapping, nn.ModuleDict)):
            named = list(layers.items())
        else:
            listed = list(layers)  # type: ignore[arg-type]
            names = names or [f"layers.{i}" for i in range(len(listed))]
            if len(names) != len(listed):
                raise ValueError(f"{len(names)} names for {len(listed)} layers; give one each")
            named = list(zip(names, listed))
        for name, layer in named:  # every layer: a draw no site reveals is keyed all the same
            self._attach_layer(name, layer, find_sites(layer))
        return self

    def attach_stage(self, module: nn.Module, index: int) -> None:
        """A pipeline's stage ``index``: a ``Stage``'s layers, or the module as one layer."""
        self.attach(module if isinstance(module, Stage) else {f"stages.{index}": module})

    def _attach_layer(self, name: str, layer: nn.Module, sites: list[Site]) -> None:
        self.sites += sites
        self.handles.append(layer.register_forward_pre_hook(self._seeding(name)))
        if self.tp_rank is None:
            return
        inner = _unwrapped(layer)
        paths = {id(m): path for path, m in inner.named_modules()}
        for site in sites:
            if site.attribute is not None and _tp_sharded(site.module):
                key = f"{name}.{paths.get(id(site.module), '?')}"
                self.handles.append(site.module.register_forward_pre_hook(self._forking(key)))
                self.handles.append(site.module.register_forward_hook(self._joining))

    def detach(self) -> None:
        """Remove every hook ``attach`` added."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.sites.clear()

    def active(self) -> bool:
        """Whether some attached dropout draws now (``p > 0``, training)."""
        return self.seed is not None and any(site.active() for site in self.sites)

    def refuse_captured(self) -> None:
        """A captured CUDA graph replays its kernels' generator offsets; it cannot re-seed
        between layers. Refused where some attached dropout has ``p > 0``."""
        if self.seed is not None and any(site.probability() > 0 for site in self.sites):
            raise ValueError(
                "seed= keys dropout per layer by seeding the generator before each layer, which a "
                "captured CUDA graph cannot do; pass cuda_graph=False, seed=None, or dropout 0"
            )

    @contextlib.contextmanager
    def running(self, microbatch: int) -> Iterator[None]:
        """Run local micro-batch ``microbatch``'s forward or backward piece keyed; the
        generators are left as found. Nothing happens where no attached dropout is active."""
        if not self.active():
            yield
            return
        with torch.random.fork_rng(devices=self._devices(), device_type=self.device.type):
            self.microbatch = self.microbatch_offset + microbatch
            try:
                yield
            finally:
                self.microbatch = None
                self._forks.clear()

    def _devices(self) -> list[int]:
        if self.device.type == "cpu":
            return []
        module = torch.get_device_module(self.device.type)
        return [self.device.index if self.device.index is not None else module.current_device()]

    def _seed(self, key: str, tp_rank: int | None = None) -> None:
        assert self.seed is not None and self.microbatch is not None
        value = layer_seed(self.seed, self.step, self.microbatch, key, tp_rank)
        torch.default_generator.manual_seed(value)
        for index in self._devices():
            torch.get_device_module(self.device.type).default_generators[index].manual_seed(value)

    def _seeding(self, name: str):
        def seed_layer(module: nn.Module, args: object) -> None:
            if self.microbatch is not None:
                self._seed(name)

        return seed_layer

    def _forking(self, key: str):
        def fork_site(module: nn.Module, args: object) -> None:
            if self.microbatch is not None:
                stack = contextlib.ExitStack()
                devices, kind = self._devices(), self.device.type
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type=kind))
                self._forks.append(stack)
                self._seed(key, self.tp_rank)

        return fork_site

    def _joining(self, module: nn.Module, args: object, output: object) -> None:
        if self.microbatch is not None and self._forks:
            self._forks.pop().close()


def for_pipeline(
    seed: int | None,
    modules: Mapping[int, nn.Module],
    device: torch.device,
    num_microbatches: int,
    replicas: object,
    mesh: object,
    captured: bool,
) -> DropoutKeys:
    """A ``Pipeline``'s keys: its local stages attached, global micro-batches counted from this
    data-parallel replica's first (its rank in ``replicas``), the tp rank where ``mesh``
    (``MeshGroups``) has a ``"tp"`` dimension; refused under a captured CUDA graph."""
    import torch.distributed as dist

    replica = dist.get_rank(replicas) if replicas is not None else 0  # type: ignore[arg-type]
    coordinates = getattr(mesh, "coordinates", {}) or {}
    keys = DropoutKeys(
        seed, device, microbatch_offset=replica * num_microbatches, tp_rank=coordinates.get("tp")
    )
    for index in sorted(modules):
        keys.attach_stage(modules[index], index)
    if captured:
        keys.refuse_captured()
    return keys
