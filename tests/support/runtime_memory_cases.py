"""What a rank holds at each compute action: the buffers of a step's activation size, on gloo, with
ProcessGroupNCCL's rule for async transfers emulated.

ProcessGroupNCCL keeps an async operation's tensors alive until the operation is waited (or its
watchdog, every 100 ms, finds it finished); gloo lets them go with the last reference. To see on
the CPU what a rank would hold on NCCL, the transfers are wrapped (``StashingWork``): each holds
its tensors in a per-process stash until ``wait()``, as NCCL's stash does (with no watchdog:
an unwaited send is held to the end of the step, the worst case of NCCL's 100 ms).

At the start of every compute action (``Executor.compute``) the rank counts the distinct storages
of exactly one activation's size that it holds, by where they are held:

* ``saved``: stage inputs kept for the backward (the in-flight micro-batches' activations);
* ``inbox``: received or handed-over values waiting for their action (``acts``, ``grads``), and
  receives posted ahead of use;
* ``outbox``: outputs and input gradients waiting for their SEND (``outbox_f``, ``outbox_b``);
* ``sending``: sends posted and not yet released (``Transport._sends``);
* ``stashed``: what the emulated NCCL stash still holds after the runtime let go of it.

``python tests/support/runtime_memory_cases.py`` prints the table per rank (the numbers in the report).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

HIDDEN, SEQ, MB = 16, 24, 2
#: one activation (and one input gradient) between stages: [MB, SEQ, HIDDEN] float64
ACTIVATION_BYTES = MB * SEQ * HIDDEN * 8
CATEGORIES = ("saved", "inbox", "outbox", "sending", "stashed")


class Stash:
    """The emulated NCCL stash of one process: tensors of transfers not yet waited, by work."""

    def __init__(self) -> None:
        self.tensors: dict[int, list[torch.Tensor]] = {}
        self.watchers: list[threading.Thread] = []

    def finish(self, timeout: float = 30.0) -> None:
        """Wait for every watcher (every transfer posted has finished), then forget them."""
        for watcher in self.watchers:
            watcher.join(timeout)
            assert not watcher.is_alive(), "a transfer never finished"
        self.watchers.clear()


class StashingWork:
    """A transfer as ProcessGroupNCCL runs it: ``is_completed`` says whether it has finished
    (a watcher thread waits for the gloo work: gloo's own ``is_completed`` stays False until
    waited), and its tensors stay in the stash until ``wait()``, finished or not."""

    def __init__(self, work, tensors: list[torch.Tensor], stash: Stash) -> None:
        self.stash = stash
        stash.tensors[id(self)] = tensors
        self._finished = threading.Event()
        watcher = threading.Thread(target=self._watch, args=(work,), daemon=True)
        watcher.start()
        stash.watchers.append(watcher)

    def _watch(self, work) -> None:
        try:
            work.wait()
        finally:
            self._finished.set()

    def is_completed(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout=None) -> bool:
        ok = self._finished.wait(None if timeout is None else timeout.total_seconds())
        if ok:
            self.stash.tensors.pop(id(self), None)
        return ok


def stash_transfers(stash: Stash) -> None:
    """Make this process's ``batch_isend_irecv`` (the runtime's one way to post on gloo) return
    works that keep their tensors in ``stash`` until waited."""
    batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        works = batch(ops)
        if len(works) == len(ops):
            return [StashingWork(w, [op.tensor], stash) for w, op in zip(works, ops)]
        return [StashingWork(w, [op.tensor for op in ops], stash) for w in works]

    dist.batch_isend_irecv = batch_isend_irecv


def _tensors(value) -> list[torch.Tensor]:
    from pipetrain.runtime.comm.p2p import Pending

    if isinstance(value, Pending):
        return list(value.buffers)
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor)]


def held(executor, stash: Stash) -> dict[str, int]:
    """Distinct activation-sized storages this rank holds, by where (module docstring); each
    storage counted once, in the first category that holds it."""
    places: dict[str, list[torch.Tensor]] = {c: [] for c in CATEGORIES}
    for runner in executor.runners.values():
        for saved in runner.saved.values():
            places["saved"] += saved.inputs
    for table in (executor.acts, executor.grads):
        for value in table.values():
            places["inbox"] += _tensors(value)
    for table in (executor.outbox_f, executor.outbox_b):
        for value in table.values():
            places["outbox"] += _tensors(value)
    for pending in executor.transport._sends:
        places["sending"] += pending.buffers
    for tensors in stash.tensors.values():
        places["stashed"] += tensors
    seen: set[int] = set()
    counts = dict.fromkeys(CATEGORIES, 0)
    for category in CATEGORIES:
        for t in places[category]:
            storage = t.untyped_storage()
            if storage.nbytes() != ACTIVATION_BYTES or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            counts[category] += 1
    return counts


def stage(index: int) -> nn.Module:
    torch.manual_seed(100 + index)
    return nn.Sequential(
        nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN)
    ).double()


def run_held(rank: int, world: int, cases: list[tuple[str, int, int]]) -> list[dict]:
    """Per case ``(schedule, stages per rank, micro-batches)``: one training step after the
    shape-discovering one and, per compute action of it, what this rank held (``held``)."""
    from pipetrain.runtime import executor as executor_module
    from pipetrain.runtime.pipeline import Pipeline

    stash = Stash()
    stash_transfers(stash)
    snapshots: list[tuple[str, dict[str, int]]] = []
    compute = executor_module.Executor.compute

    def counting(self, action):
        snapshots.append((str(action), held(self, stash)))
        return compute(self, action)

    executor_module.Executor.compute = counting
    results = []
    try:
        for schedule, v, n in cases:
            pipe = Pipeline(
                stage,
                schedule,
                n,
                lambda out, y: ((out - y) ** 2).mean(),
                stages_per_rank=v,
                num_stages=v * world,
            )
            g = torch.Generator().manual_seed(0)
            x = torch.randn(n * MB, SEQ, HIDDEN, generator=g, dtype=torch.float64)
            y = torch.randn(n * MB, SEQ, HIDDEN, generator=g, dtype=torch.float64)
            pipe.step(x, y)  # discovers shapes (metadata messages, blocking)
            stash.finish()
            stash.tensors.clear()  # what that step left unwaited (NCCL's watchdog would sweep it)
            snapshots.clear()
            pipe.step(x, y)
            stash.finish()
            pipe.close()
            results.append({"case": (schedule, v, n), "actions": list(snapshots)})
            stash.tensors.clear()
    finally:
        executor_module.Executor.compute = compute
    return results


def peaks(result: dict) -> dict[str, int]:
    """Per category its largest count over the step, and the largest total."""
    out = {c: max(counts[c] for _, counts in result["actions"]) for c in CATEGORIES}
    out["total"] = max(sum(counts.values()) for _, counts in result["actions"])
    return out


CASES = [("1f1b", 1, 16), ("interleaved-1f1b", 2, 8), ("zbv", 2, 8)]


def main() -> None:
    from runtime_harness import launch

    kib = ACTIVATION_BYTES / 1024
    print(
        f"activation-sized buffers held at a compute action, most over a step (one = {kib:g} KiB)"
    )
    print("| schedule | ranks | mb | rank | " + " | ".join(CATEGORIES) + " | total |")
    print("|---|---|---|---|" + "---|" * (len(CATEGORIES) + 1))
    for world in (2, 4):
        per_rank = launch(world, run_held, CASES)
        for i, (schedule, _, n) in enumerate(CASES):
            for rank, results in enumerate(per_rank):
                p = peaks(results[i])
                cells = " | ".join(str(p[c]) for c in (*CATEGORIES, "total"))
                print(f"| {schedule} | {world} | {n} | {rank} | {cells} |")


if __name__ == "__main__":
    main()
