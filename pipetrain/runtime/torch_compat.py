"""Every torch interface the runtime uses that torch does not promise to keep, in one place.

The split backward walks and replays autograd graphs and enters the engine directly; the failure
paths read the process group's store. Those are private (leading underscore) or undocumented
attributes, so a torch release may change them without notice. Here each one is named once,
wrapped in a small function, and listed in ``PRIVATE_APIS`` with the check ``check_private_apis``
runs: a test calls it, so a torch that changed one fails that test with the API's name, not deep
inside a step with an ``AttributeError``. Nothing else in ``pipetrain`` touches a private name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils._python_dispatch import TorchDispatchMode  # a mode that sees aten calls

__all__ = [
    "PRIVATE_APIS",
    "GradientEdge",
    "Node",
    "TorchDispatchMode",
    "accumulate_grad_variable",
    "add_lists_",
    "check_private_apis",
    "copy_lists_",
    "count_output_bytes",
    "device_spin",
    "engine_run_backward",
    "fsdp_post_backward",
    "get_gradient_edge",
    "graph_break_refused",
    "post_accumulate_grad_hooks",
    "profiler_enabled",
    "saved_by_selective_recompute",
    "saved_tensors_hooked",
    "store_of",
    "version_of",
]

_engine_run_backward: Callable[..., tuple[torch.Tensor, ...]] | None
try:  # the engine entry point behind torch.autograd.grad / backward (skips their checks)
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # pragma: no cover - other torch versions: the public wrappers below
    _engine_run_backward = None


def engine_run_backward(
    roots: Sequence[GradientEdge],
    grads: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    retain_graph: bool,
    accumulate: bool,
):
    """``torch.autograd.backward`` (``accumulate``: into ``.grad``, returns nothing useful) or
    ``torch.autograd.grad`` (``allow_unused``: a tuple with ``None`` for unreached inputs),
    entered at the engine itself when every root gradient is a tensor: the public functions'
    argument checks cost more host time than a small stage's backward kernels take to launch."""
    if _engine_run_backward is None or not all(isinstance(g, torch.Tensor) for g in grads):
        if accumulate:
            return torch.autograd.backward(
                list(roots), list(grads), retain_graph=retain_graph, inputs=list(inputs)
            )
        return torch.autograd.grad(
            list(roots), list(inputs), list(grads), retain_graph=retain_graph, allow_unused=True
        )
    return _engine_run_backward(
        tuple(roots),
        tuple(grads),
        retain_graph,
        False,
        tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=accumulate,
    )


def accumulate_grad_variable(node: Node) -> torch.Tensor | None:
    """The leaf tensor of an ``AccumulateGrad`` node (its undocumented ``variable`` attribute), or
    ``None`` for any other node: what ``get_gradient_edge(leaf).node`` finds, at a fraction of
    the cost, while the graph is walked anyway."""
    return getattr(node, "variable", None)


def add_lists_(into: list[torch.Tensor], adds: list[torch.Tensor]) -> None:
    """``into[i] += adds[i]`` for every ``i`` in one C++ loop (``torch._foreach_add_``).

    ``DTensor`` gradients (tensor parallel, FSDP2) add their local shards where both sides are
    placed alike — a pending sum (``Partial``) adds to a pending sum — and as DTensors otherwise;
    ``_foreach_add_`` refuses a list mixing them with plain tensors."""
    from torch.distributed.tensor import DTensor

    plain_into, plain_adds = [], []
    for i, a in zip(into, adds):
        if isinstance(i, DTensor) and isinstance(a, DTensor) and i.placements == a.placements:
            plain_into.append(i.to_local())
            plain_adds.append(a.to_local())
        elif isinstance(i, DTensor) or isinstance(a, DTensor):
            i.add_(a)
        else:
            plain_into.append(i)
            plain_adds.append(a)
    if plain_into:
        torch._foreach_add_(plain_into, plain_adds)


def copy_lists_(into: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``into[i].copy_(sources[i])`` for every ``i`` in one call (``torch._foreach_copy_``): a
    captured step's batch into its static buffers with one launch, not one per tensor."""
    if into:
        torch._foreach_copy_(into, sources)


def post_accumulate_grad_hooks(param: torch.Tensor) -> int:
    """How many post-accumulate-grad hooks ``param`` has (``register_post_accumulate_grad_hook``
    keeps them in the undocumented ``_post_accumulate_grad_hooks``): a captured step refuses them,
    since a replay would not run them."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return len(hooks) if hooks else 0


def has_tensor_hooks(param: torch.Tensor) -> bool:
    """Whether ``param`` has hooks from ``Tensor.register_hook`` (kept in the undocumented
    ``_backward_hooks``): they run on any gradient computed for it, captured or accumulated."""
    return bool(getattr(param, "_backward_hooks", None))


def version_of(t: torch.Tensor) -> int:
    """How often ``t`` was changed in place, through itself or a view of its storage (autograd's
    version counter, ``Tensor._version``): a value built from ``t`` is stale once this moves."""
    return t._version


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are active here (``torch._C._autograd.
    _top_saved_tensors_default_hooks``): activation checkpointing's forward and recompute, and
    activation offload, run under them — code there must run the same operations each time."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def store_of(group) -> dist.Store:
    """The key-value store behind ``group`` (the default group's when ``group`` is ``None``),
    for exchanges that must honour a timeout of their own (``dist.Store.wait`` takes one; gloo's
    object collectives ignore the pipeline's)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store() if group is None else c10d._get_process_group_store(group)


def device_spin(cycles: int) -> None:
    """Keep the current CUDA stream busy for ``cycles`` clock cycles while the host goes on: the
    profiler queues a piece of work behind it to time the device alone (``profile_clock``)."""
    torch.cuda._sleep(cycles)


def _check_device_spin() -> None:
    if not callable(torch.cuda._sleep):
        raise AttributeError("torch.cuda._sleep is not callable")


def profiler_enabled() -> bool:
    """Whether a torch profiler records this thread (``torch.profiler.profile``, ``emit_nvtx``):
    the executor labels its actions only then, since an idle ``record_function`` still makes a
    dispatcher call per action, where this is a flag read."""
    return torch._C._autograd._profiler_enabled()


#: the attention kernels whose outputs selective recompute keeps (private aten ops: each
#: ``torch.nn.functional.scaled_dot_product_attention`` backend is one)
_ATTENTION_OPS = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)


def saved_by_selective_recompute() -> list:
    """The aten ops whose outputs selective recompute keeps: the matrix products and the fused
    attention kernels (``runtime.backward.activation_checkpoint``); an attention op this torch
    lacks is left out (``_check_attention_ops`` says when none is left)."""
    aten = torch.ops.aten
    ops = [aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default]
    for name in _ATTENTION_OPS:
        packet = getattr(aten, name, None)
        if packet is not None:
            ops.append(packet.default)
    return ops


@contextlib.contextmanager
def count_output_bytes(ops: Sequence) -> Iterator[list[int]]:
    """Inside the block, count the bytes of the distinct storages the aten ``ops`` return (a
    ``TorchDispatchMode``); the yielded one-element list holds the total. The profiler counts
    what selective recompute caches this way: the cache is not a saved tensor, so
    ``saved_tensors_hooks`` never see it."""
    wanted = set(ops)
    seen: set[int] = set()
    total = [0]

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in wanted:
                for t in out if isinstance(out, tuple | list) else (out,):
                    if isinstance(t, torch.Tensor):
                        storage = t.untyped_storage()
                        if storage.data_ptr() not in seen:
                            seen.add(storage.data_ptr())
                            total[0] += storage.nbytes()
            return out

    with _Count():
        yield total


def _check_count_output_bytes() -> None:
    a = torch.ones(2, 3)
    with count_output_bytes([torch.ops.aten.mm.default]) as total:
        torch.mm(a, a.t())
        _ = a * 2.0  # not counted
    if total != [2 * 2 * 4]:
        raise AssertionError(f"counted {total[0]} bytes of one 2x2 float32 mm output, not 16")


def _check_attention_ops() -> None:
    missing = [n for n in _ATTENTION_OPS if getattr(torch.ops.aten, n, None) is None]
    if len(missing) == len(_ATTENTION_OPS):
        raise AttributeError(f"none of the attention ops {', '.join(missing)} exists")


def _check_engine() -> None:
    if _engine_run_backward is None:
        raise AttributeError("torch.autograd.graph._engine_run_backward is missing")
    x = torch.ones(2, requires_grad=True)
    y = (x * 3.0).sum()
    (g,) = engine_run_backward(
        [get_gradient_edge(y)], [torch.ones(())], [x], retain_graph=False, accumulate=False
    )
    if not torch.equal(g, torch.full((2,), 3.0)):
        raise AssertionError(f"engine_run_backward returned {g}, expected [3, 3]")


def _check_variable() -> None:
    x = torch.ones(2, requires_grad=True)
    node = get_gradient_edge(x).node
    if accumulate_grad_variable(node) is not x:
        raise AssertionError("AccumulateGrad.variable is not the leaf tensor")
    y = x * 2.0
    if y.grad_fn is None or accumulate_grad_variable(y.grad_fn) is not None:
        raise AssertionError("a non-leaf node has a 'variable' attribute")


def _check_foreach() -> None:
    a = [torch.zeros(2), torch.ones(3)]
    add_lists_(a, [torch.ones(2), torch.ones(3)])
    if not (torch.equal(a[0], torch.ones(2)) and torch.equal(a[1], torch.full((3,), 2.0))):
        raise AssertionError("torch._foreach_add_ did not add in place")


def _check_copy_lists() -> None:
    a = [torch.zeros(2), torch.zeros(3)]
    copy_lists_(a, [torch.ones(2), torch.full((3,), 2.0)])
    if not (torch.equal(a[0], torch.ones(2)) and torch.equal(a[1], torch.full((3,), 2.0))):
        raise AssertionError("torch._foreach_copy_ did not copy in place")


def _check_post_accumulate_hooks() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    if post_accumulate_grad_hooks(p) != 0:
        raise AssertionError("a new parameter reports post-accumulate-grad hooks")
    handle = p.register_post_accumulate_grad_hook(lambda t: None)
    found = post_accumulate_grad_hooks(p)
    handle.remove()
    if found != 1:
        raise AssertionError("Tensor._post_accumulate_grad_hooks does not hold registered hooks")


def _check_tensor_hooks() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    if has_tensor_hooks(p):
        raise AssertionError("a new parameter reports tensor hooks")
    handle = p.register_hook(lambda g: g)
    found = has_tensor_hooks(p)
    handle.remove()
    if not found or has_tensor_hooks(p):
        raise AssertionError("Tensor._backward_hooks does not hold register_hook's hooks")


def _check_version() -> None:
    t = torch.zeros(4)
    before = version_of(t)
    t[:2].add_(1.0)  # through a view
    if version_of(t) == before:
        raise AssertionError("Tensor._version does not count an in-place change through a view")


def _check_saved_tensors_hooked() -> None:
    if saved_tensors_hooked():
        raise AssertionError("saved-tensor hooks reported where none is active")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        if not saved_tensors_hooked():
            raise AssertionError("_top_saved_tensors_default_hooks does not see active hooks")


def _check_prehook() -> None:
    x = torch.ones(2, requires_grad=True)
    y = x * 2.0
    seen: list = []
    node = y.grad_fn
    if node is None:
        raise AssertionError("a product of a leaf that needs a gradient has no grad_fn")
    handle = node.register_prehook(lambda grads: seen.append(grads))
    y.sum().backward()
    handle.remove()
    if len(seen) != 1:
        raise AssertionError("Node.register_prehook's hook did not run once")


def _check_store() -> None:
    from torch.distributed import distributed_c10d as c10d

    for name in ("_get_default_store", "_get_process_group_store"):
        if not callable(getattr(c10d, name, None)):
            raise AttributeError(f"torch.distributed.distributed_c10d.{name} is missing")
    if not hasattr(dist.Store, "wait") or not hasattr(dist.Store, "add"):
        raise AttributeError("torch.distributed.Store lacks wait/add")
    _ = timedelta  # Store.wait takes a list of keys and a timedelta


def fsdp_post_backward(module) -> None:
    """What the end of ``loss.backward()`` does for an FSDP2 root (``fully_shard``): each
    parameter group's post-backward (reduce-scatter of the accumulated gradient, reshard), then
    the root's final callback (wait for the reductions). The pipeline runs a stage's backward in
    pieces across the step, so it calls this itself once, after the stage's last piece
    (torch.distributed.pipelining does the same)."""
    from torch.distributed.fsdp import fully_shard

    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for inner in state._state_ctx.all_states:
        groups = getattr(inner, "_fsdp_param_groups", None)  # torch >= 2.12: a list
        if groups is None:
            single = getattr(inner, "_fsdp_param_group", None)
            groups = [single] if single is not None else []
        for group in groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def _check_fsdp() -> None:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    if not callable(getattr(fully_shard, "state", None)):
        raise AttributeError("fully_shard.state is missing")
    if not callable(getattr(FSDPState, "_root_post_backward_final_callback", None)):
        raise AttributeError("FSDPState._root_post_backward_final_callback is missing")
    if not callable(getattr(FSDPParamGroup, "post_backward", None)):
        raise AttributeError("FSDPParamGroup.post_backward is missing")


def _check_profiler() -> None:
    if profiler_enabled():
        raise AssertionError("_profiler_enabled() is True with no profiler running")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        if not profiler_enabled():
            raise AssertionError("_profiler_enabled() is False inside torch.profiler.profile()")


def graph_break_refused(error: BaseException) -> bool:
    """Whether ``error`` is dynamo refusing a graph break (a module compiled with
    ``fullgraph=True`` reaching a ``torch.compiler.disable``d function). Dynamo is looked up in
    ``sys.modules`` only: a process that compiled nothing never imports it here."""
    import sys

    exc = sys.modules.get("torch._dynamo.exc")
    return exc is not None and isinstance(error, exc.Unsupported)


def _check_graph_break() -> None:
    import torch._dynamo.exc as exc

    assert issubclass(exc.Unsupported, Exception)


#: (API, what pipetrain uses it for, check). ``check_private_apis`` runs every check.
def in_backward() -> bool:
    """Whether this thread runs a backward (a graph task's id; -1 outside, or no such id)."""
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def _check_in_backward() -> None:
    seen: list[bool] = []
    (y := torch.ones(1, requires_grad=True) * 2).register_hook(lambda g: seen.append(in_backward()))
    y.backward()
    if in_backward() or seen != [True]:
        raise RuntimeError(f"in_backward: {in_backward()} outside, {seen} inside a backward")


PRIVATE_APIS: tuple[tuple[str, str, Callable[[], None]], ...] = (
    (
        "torch._C._current_graph_task_id",
        "tell a checkpoint's recompute (inside a backward) from a forward (extra_losses)",
        _check_in_backward,
    ),
    (
        "torch.autograd.graph._engine_run_backward",
        "enter the autograd engine without autograd.grad/backward's argument checks",
        _check_engine,
    ),
    (
        "AccumulateGrad node attribute 'variable'",
        "find a leaf's gradient node while walking a graph (split_backward)",
        _check_variable,
    ),
    ("torch._foreach_add_", "add many gradients into .grad in one call", _check_foreach),
    ("torch._foreach_copy_", "copy a batch into a captured step's buffers", _check_copy_lists),
    (
        "Tensor._post_accumulate_grad_hooks",
        "refuse hooks a replayed CUDA graph would not run",
        _check_post_accumulate_hooks,
    ),
    (
        "Tensor._backward_hooks",
        "refuse precompile's stand-in passes where a tensor hook would run",
        _check_tensor_hooks,
    ),
    (
        "Tensor._version",
        "reuse a mask built from side inputs only while they are unchanged (pipetrain.hf)",
        _check_version,
    ),
    (
        "torch._C._autograd._top_saved_tensors_default_hooks",
        "build masks afresh inside checkpointed regions, as their recompute does (pipetrain.hf)",
        _check_saved_tensors_hooked,
    ),
    (
        "torch.autograd.graph.Node.register_prehook",
        "capture and pin the gradient entering a boundary node (split_backward)",
        _check_prehook,
    ),
    (
        "torch.distributed.distributed_c10d._get_default_store / _get_process_group_store",
        "agree across ranks with a timeout (agreement, failure notices)",
        _check_store,
    ),
    (
        "fully_shard.state / FSDPState._state_ctx, _root_post_backward_final_callback / "
        "FSDPParamGroup.post_backward",
        "reduce an FSDP2 stage's gradient once per step, after its last backward piece",
        _check_fsdp,
    ),
    (
        "torch.utils._python_dispatch.TorchDispatchMode",
        "count what selective recompute caches, and record the collectives a tensor-parallel "
        "layer issues (the profiler)",
        _check_count_output_bytes,
    ),
    (
        "torch.ops.aten._scaled_dot_product_*_attention",
        "keep fused attention outputs under selective recompute",
        _check_attention_ops,
    ),
    (
        "torch._dynamo.exc.Unsupported",
        "name a fullgraph=True block that deferral would break (deferred_wgrad)",
        _check_graph_break,
    ),
    (
        "torch.cuda._sleep",
        "queue a piece of work behind a busy device to time the device alone (profile_clock)",
        _check_device_spin,
    ),
    (
        "torch._C._autograd._profiler_enabled",
        "label each action for a user's profile only while a profiler records",
        _check_profiler,
    ),
)


def check_private_apis() -> list[str]:
    """Run every check; returns one line per API that changed (empty: this torch is fine)."""
    broken = []
    for name, use, check in PRIVATE_APIS:
        try:
            check()
        except Exception as e:
            broken.append(
                f"{name} (used to {use}) changed in torch {torch.__version__}: "
                f"{type(e).__name__}: {e}"
            )
    return broken
