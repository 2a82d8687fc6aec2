"""Which rows ``incumbents.py`` measures for a configuration (shape, micro-batches, schedule),
and each row's cut: pipetrain's from ``pipetrain.planner`` on the ``account`` shapes (costs from
FLOP counts, a costs file, or pipetrain's profiler on rank 0), the incumbents' by their rule
(``incumbents_shapes``); Megatron's interleaved variants swept, or the fastest of an earlier
launch (``--megatron-tuned-from``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.gpu_setup import Ctx
from benchmarks.incumbents.incumbents_shapes import (
    FAMS,
    Row,
    Shape,
    UnitBank,
    analytic_costs,
    incumbent_cut,
    interleave_options,
    memory_gib,
    planner_cut,
)


class Plan:
    """Which rows a configuration gets, and each row's cut (pipetrain's from the planner on
    ``account`` shapes, unless ``--pipetrain-cut incumbent``)."""

    def __init__(self, ctx: Ctx, bank: UnitBank) -> None:
        self.ctx, self.bank, self.args = ctx, bank, ctx.args
        self.libs = set(self.args.libraries.split(","))
        self.tuned = tuned_variants(self.args.megatron_tuned_from, self.args.megatron_top)
        self._costs: dict[str, object] = {}
        self.cuts: dict[str, list] = {}

    def costs(self, shape: Shape):
        if shape.name not in self._costs:
            how = self.args.costs
            if how == "analytic":
                self._costs[shape.name] = analytic_costs(shape)
            elif how == "profile":
                self._costs[shape.name] = self.ctx.agree(profile_costs(self.ctx, self.bank, shape))
            else:
                self._costs[shape.name] = json.loads(Path(how).read_text())
        return self._costs[shape.name]

    def pipetrain_cut(self, shape: Shape, schedule: str, n: int) -> tuple[int, ...]:
        fam, world = FAMS[schedule], self.ctx.world
        if shape.cut != "account" or self.args.pipetrain_cut == "incumbent":
            return incumbent_cut(shape, fam.v * world)
        cut = planner_cut(self.costs(shape), schedule, world, fam.v, n, memory_gib(self.ctx.device))
        self.cuts.setdefault(shape.name, []).append([schedule, n, list(cut)])
        return cut

    def rows(self, shape: Shape, n: int, schedule: str) -> list[Row]:
        fam, world = FAMS[schedule], self.ctx.world
        pt = self.pipetrain_cut(shape, schedule, n)
        libs = ["pipetrain", *(f"pipetrain-{x}" for x in self.args.variants.split(",") if x)]
        inc = incumbent_cut(shape, fam.v * world)
        cut = {"pipetrain-samecut": inc}  # the incumbents' cut: equal layers per rank
        rows = [Row(shape, schedule, n, lib, fam.v, cut.get(lib, pt)) for lib in libs]
        if schedule in self.args.torch_schedules.split(","):
            rows.append(Row(shape, schedule, n, "torch", fam.v, inc))
        extra: list[str] = []
        if schedule == "1f1b":
            megatron = ("megatron", "megatron-nosync", "megatron-nosync-graph", "megatron-gaf")
            extra = [x for x in megatron if x in self.libs]
            extra += [x for x in ("deepspeed", "deepspeed-bf16") if x in self.libs]
        if schedule == "dualpipev" and "deepspeed-dualpipev" in self.libs:
            extra.append("deepspeed-dualpipev")
        rows += [Row(shape, schedule, n, lib, fam.v, inc) for lib in extra]
        if schedule == "interleaved-1f1b":
            from benchmarks.incumbents.incumbents_megatron import parse

            chosen = self.megatron_interleaved(shape, n)
            if "megatron-tuned-graph" in self.libs:  # its best variants also as one CUDA graph
                chosen += [f"{lib}-graph" for lib in self.tuned.get((shape.name, n), [])]
            for lib in chosen:
                v = parse(lib).v
                rows.append(Row(shape, schedule, n, lib, v, incumbent_cut(shape, v * world)))
        return rows

    def megatron_interleaved(self, shape: Shape, n: int) -> list[str]:
        from benchmarks.incumbents.incumbents_megatron import name, sweep

        world, vs = self.ctx.world, interleave_options(shape, self.ctx.world)
        if not vs:
            return []
        if "megatron-sweep" in self.libs:
            return sweep(vs, n, world)
        if "megatron-sweep-nowf" in self.libs:  # warm-up/flush overlap hung at 4 ranks here
            return [lib for lib in sweep(vs, n, world) if not lib.endswith("-wf")]
        if "megatron-tuned" in self.libs and self.tuned.get((shape.name, n)):
            return self.tuned[(shape.name, n)]
        v = 2 if 2 in vs else vs[0]  # the default, v = 2, where the layers allow it
        if "megatron-tuned" in self.libs:  # no earlier launch to tune from: with and without wf
            return [name(v, None, False, world), name(v, None, True, world)]
        return [name(v, None, False, world)] if "megatron" in self.libs else []


def tuned_variants(paths: str, top: int) -> dict[tuple[str, int], list[str]]:
    """From earlier launches' JSON: per (shape, micro-batches), the ``top`` fastest Megatron
    interleaved rows (mean of their medians over the files)."""
    times: dict[tuple[str, int, str], list[float]] = {}
    for p in filter(None, paths.split(",")):
        if not Path(p).exists():
            continue
        for r in json.loads(Path(p).read_text())["rows"]:
            if r["lib"].startswith("megatron-v") and "median_ms" in r:
                times.setdefault((r["shape"], r["microbatches"], r["lib"]), []).append(
                    r["median_ms"]
                )
    best: dict[tuple[str, int], list[tuple[float, str]]] = {}
    for (shape, n, lib), ms in times.items():
        best.setdefault((shape, n), []).append((sum(ms) / len(ms), lib))
    return {k: [lib for _, lib in sorted(v)[:top]] for k, v in best.items()}


def profile_costs(ctx: Ctx, bank: UnitBank, shape: Shape):
    """pipetrain's profiler on rank 0 over the whole chain of units (docs/planning.md)."""
    if ctx.rank != 0:
        return None
    import pipetrain

    units = [bank.unit(shape, i) for i in range(shape.units)]
    x, y = shape.batch(ctx.device, ctx.dtype, 1)
    costs = pipetrain.profile(units, x, loss_fn=shape.loss, target=y)
    del units
    ctx.mem_reset()
    return costs


def launch_order(rows: list, launch: int, index: int) -> list:
    """The order ``rows`` run in launch ``launch`` for its ``index``-th configuration: rotated by
    ``launch // 2 + index`` (a different row first from one pair of launches to the next: the
    first row of a launch has measured up to 2% faster), and reversed in odd launches, so that
    every two launches run every pair of rows both ways round — adjacent rows kept one order in
    every launch of a plain rotation, which favoured the first of them."""
    k = (launch // 2 + index) % len(rows) if rows else 0
    order = rows[k:] + rows[:k]
    return order[::-1] if launch % 2 else order
