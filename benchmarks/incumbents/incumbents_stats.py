"""Pooled tables, 95% intervals and docs/incumbents.md's targets over several launches of
``incumbents.py`` (``incumbents.py --report FILE...`` or ``python incumbents_stats.py FILE...``;
needs neither torch nor a GPU).

Files are grouped by machine (device name and ranks); within a group every file is a launch.
A row's step time is the mean over launches of its launch medians; each ratio comes with its
two-level bootstrap interval over launches and steps (``intervals.py``), and a target counts as
met only where the interval's far end meets it. The noise floor printed with each group is the
interval of each pipetrain row against itself, launch against the next launch, and the
step-to-step coefficient of variation.

Reference rows: "Megatron same" is the fastest Megatron row of the same schedule family (1F1B:
``megatron`` or ``megatron-nosync``; interleaved: the fastest ``megatron-v*`` variant);
"Megatron best" the fastest Megatron row of the configuration, any schedule. The fastest is picked
by the point estimate, then its interval computed: a choice among many noisy rows favours the
incumbent (the winner's luck counts for it).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.common.intervals import (
    Interval,
    launch_spread,
    location,
    ratio_interval,
    self_interval,
    step_cv,
    verdict,
)

ORDER = ("1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
LIBS = ("pipetrain", "megatron", "deepspeed", "torch")
#: 2 ranks: pipetrain's best ≤ 0.97 × Megatron's best; 4 ranks: ≤ 0.93 (issue 21)
BEST_TARGET = {2: 0.97, 4: 0.93}
#: bootstrap draws per interval (incumbents_call.py asks for fewer in its summaries between parts)
RESAMPLES = int(os.environ.get("INCUMBENTS_RESAMPLES", "2000"))


class Group:
    """One configuration (shape, micro-batches) over the launches of one machine."""

    def __init__(self, shape: str, n: int, launches: int) -> None:
        self.shape, self.n, self.k = shape, n, launches
        self.steps: dict[tuple[str, str], list[list[float]]] = {}
        self.rows: dict[tuple[str, str], dict] = {}
        #: per row, each launch's peak allocated memory per rank
        self.peaks: dict[tuple[str, str], list[list[float]]] = {}
        self.limits: dict[str, list[list[float]]] = {}
        self.gc_ms: dict[tuple[str, str], list[float]] = {}
        #: per row, its place in each launch's order (None: not measured there)
        self.places: dict[tuple[str, str], list[int | None]] = {}
        self._ratios: dict[tuple, Interval | None] = {}

    def add(self, launch: int, row: dict, limits: dict) -> None:
        key = (row["schedule"], row["lib"])
        self.steps.setdefault(key, [[] for _ in range(self.k)])
        self.steps[key][launch] = [float(t) for t in row.get("all_ms") or []]
        self.places.setdefault(key, [None] * self.k)
        if row.get("all_ms") and "order" in row:
            self.places[key][launch] = int(row["order"])
        if "all_ms" in row or key not in self.rows:
            self.rows[key] = row
        if row.get("all_ms") and row.get("peak_total_gib"):
            self.peaks.setdefault(key, []).append([float(m) for m in row["peak_total_gib"]])
        self.gc_ms.setdefault(key, []).extend(row.get("gc_pause_ms") or [])
        lk = row.get("limit_key")
        if lk and "all_ms" in limits.get(lk, {}):
            self.limits.setdefault(lk, [[] for _ in range(self.k)])
            self.limits[lk][launch] = list(limits[lk]["all_ms"])

    def peak(self, key) -> list[float]:
        """Per rank, the median over launches of the row's peak allocated memory: a launch's
        first configuration also holds the process's one-time allocations (library workspaces),
        whichever row it ran first, so one launch's peak says more about the order than the row."""
        launches = self.peaks.get(key, [])
        return [statistics.median(ranks) for ranks in zip(*launches)] if launches else []

    def measured(self, key) -> bool:
        return any(self.steps.get(key, []))

    def ms(self, key) -> float:
        return location([x for x in self.steps[key] if x])

    def fastest(self, keep: Callable[[tuple[str, str]], bool]):
        keys = [k for k in self.steps if keep(k) and self.measured(k)]
        return min(keys, key=self.ms) if keys else None

    def ratio(self, a, b) -> Interval | None:
        if a is None or b is None:
            return None
        if (a, b) not in self._ratios:
            self._ratios[a, b] = ratio_interval(self.steps[a], self.steps[b], resamples=RESAMPLES)
        return self._ratios[a, b]

    def one_sided_order(self, a, b) -> str:
        """A warning where ``a`` ran on the same side of ``b`` in every launch that paired them:
        the first row of a launch has measured up to 2% faster than later ones
        (docs/incumbents.md), as large as the margins these ratios are read against; empty where
        the order varied, is not recorded, or one launch paired them."""
        pairs = [
            (x, y)
            for x, y in zip(self.places.get(a, []), self.places.get(b, []))
            if x is not None and y is not None
        ]
        if len(pairs) < 2 or len({x < y for x, y in pairs}) > 1:
            return ""
        side = "before" if pairs[0][0] < pairs[0][1] else "after"
        return f" (order one-sided: {a[1]} ran {side} {b[1]} in all {len(pairs)} paired launches)"

    def efficiency(self, key) -> Interval | None:
        lk = self.rows[key].get("limit_key")
        if not lk or lk not in self.limits:
            return None
        if ("limit", key) not in self._ratios:
            iv = ratio_interval(self.limits[lk], self.steps[key], resamples=RESAMPLES)
            self._ratios["limit", key] = iv
        return self._ratios["limit", key]

    def megatron_same(self, schedule: str):
        return self.fastest(lambda k: k[0] == schedule and k[1].startswith("megatron"))

    def megatron_best(self):
        return self.fastest(lambda k: k[1].startswith("megatron"))

    def same(self, schedule: str, lib: str):
        key = (
            schedule,
            "deepspeed-dualpipev" if lib == "deepspeed" and schedule == "dualpipev" else lib,
        )
        return key if self.measured(key) else None


def load(paths: list[Path]) -> dict[tuple[str, int, str], list[dict]]:
    """Launches per machine and collector policy: (device, ranks, gc) -> the files' data, in
    launch order (launches with the collector on and off are not pooled)."""
    out: dict[tuple[str, int, str], list[dict]] = {}
    for p in paths:
        data = json.loads(p.read_text())
        data["path"] = str(p)
        meta = data["meta"]
        key = (meta["device"], meta["world"], meta.get("gc", "python"))
        out.setdefault(key, []).append(data)
    for runs in out.values():
        runs.sort(key=lambda d: d["meta"].get("launch", 0))
    return out


def groups(runs: list[dict]) -> list[Group]:
    found: dict[tuple[str, int], Group] = {}
    for i, data in enumerate(runs):
        for row in data["rows"]:
            key = (row["shape"], row["microbatches"])
            found.setdefault(key, Group(*key, len(runs))).add(i, row, data.get("limits", {}))
    return list(found.values())


def _lib_rank(lib: str) -> tuple[int, str]:
    base = next((i for i, x in enumerate(LIBS) if lib.startswith(x)), len(LIBS))
    return base, lib


def _cell(iv: Interval | None) -> str:
    return "" if iv is None else str(iv)


def _gib(mem: list[float]) -> str:
    return "/".join(f"{m:.2f}" for m in mem) if mem else "-"


def table(g: Group) -> list[str]:
    lines = [
        "| schedule | lib | v | launches × steps | step ms | step CV | slowest / median "
        "| launch spread | eff [95%] | peak GiB per rank (launches' median) | / Megatron same [95%] "
        "| / Megatron best [95%] | / torch same [95%] | / DeepSpeed same [95%] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    best = g.megatron_best()
    keys = sorted(g.rows, key=lambda k: (ORDER.index(k[0]), _lib_rank(k[1])))
    for key in keys:
        row, (schedule, lib) = g.rows[key], key
        if not g.measured(key):
            why = (row.get("error") or row.get("skipped") or "?")[:160]
            lines.append(f"| {schedule} | {lib} | {row.get('v', '')} | {why} |" + " |" * 10)
            continue
        runs = [x for x in g.steps[key] if x]
        cv, spread = step_cv(runs), launch_spread(runs)
        mine = lib.startswith("pipetrain")
        cells = [
            f"{len(runs)} × {min(map(len, runs))}",
            f"{g.ms(key):.1f}",
            "" if cv is None else f"{cv:.2%}",
            f"{max(max(x) / statistics.median(x) for x in runs):.3f}",  # intermittent slow steps
            "" if spread is None else f"{spread:.2%}",
            _cell(g.efficiency(key)) if mine else "",
            _gib(g.peak(key)),
            _cell(g.ratio(key, g.megatron_same(schedule))) if mine else "",
            _cell(g.ratio(key, best)) if mine else "",
            _cell(g.ratio(key, g.same(schedule, "torch"))) if mine else "",
            _cell(g.ratio(key, g.same(schedule, "deepspeed"))) if mine else "",
        ]
        lines.append(f"| {schedule} | {lib} | {row.get('v', '')} | " + " | ".join(cells) + " |")
    return lines


def noise(g: Group) -> str:
    floors = [
        (iv, lib)
        for (s, lib) in g.steps
        if lib.startswith("pipetrain")
        and (iv := self_interval([x for x in g.steps[(s, lib)] if x]))
    ]
    cvs = [c for k in g.steps if g.measured(k) and (c := step_cv([x for x in g.steps[k] if x]))]
    cv = f"median step CV {sorted(cvs)[len(cvs) // 2]:.2%}" if cvs else "no steps"
    if not floors:
        return f"- noise floor: one launch (no launch-to-launch floor); {cv}"
    widest = max(floors, key=lambda f: f[0].half_width)
    return (
        f"- noise floor: a pipetrain row against itself, launch against the next, 95% interval "
        f"half-width up to ±{widest[0].half_width:.3f} ({widest[1]}: {widest[0]}); {cv}"
    )


def gc_line(g: Group) -> list[str]:
    """Where the garbage collector paused a timed step (the slowest rank's pause per step)."""
    hits = [
        f"{lib} {s}: {sum(ms):.0f} ms over {sum(t > 1.0 for t in ms)} of {len(ms)} steps "
        f"(max {max(ms):.0f})"
        for (s, lib), ms in sorted(g.gc_ms.items())
        if ms and max(ms) > 1.0
    ]
    recorded = any(g.gc_ms.values())
    if not recorded:
        return []
    return ["- collector pauses over 1 ms: " + ("; ".join(hits) if hits else "none")]


def targets(g: Group, world: int) -> list[str]:
    where = f"{g.shape}, {world} ranks, {g.n} mb"
    out = []
    for s in ("1f1b", "interleaved-1f1b"):
        ref = g.megatron_same(s)
        if ref is None:
            continue
        for lib in ("pipetrain", "pipetrain-nodefer"):
            iv = g.ratio((s, lib) if g.measured((s, lib)) else None, ref)
            if iv is None:
                continue
            equal = lib.endswith("nodefer")
            target = 1.01 if equal else 1.00
            v = verdict(iv, target)
            if equal and v == "met" and iv.estimate > 1.0:
                v = "missed (estimate above 1.00)"
            kind = "equal kernels" if equal else "defaults"
            line = f"- {where}: {lib} {s} / {ref[1]} ({kind}): {iv}, target ≤ {target}: {v}"
            out.append(line + g.one_sided_order((s, lib), ref))
        fused = (
            g.ratio((s, "pipetrain"), (s, "pipetrain-nodefer"))
            if g.measured((s, "pipetrain-nodefer")) and g.measured((s, "pipetrain"))
            else None
        )
        if fused:
            out.append(
                f"- {where}: {s}: what the fused weight-gradient accumulation gives "
                f"(pipetrain / pipetrain-nodefer): {fused}"
            )
    out += best_line(g, world, where)
    out += efficiency_lines(g, where)
    out += memory_lines(g, where)
    return out


def best_line(g: Group, world: int, where: str) -> list[str]:
    mine = g.fastest(lambda k: k[1].startswith("pipetrain"))
    ref = g.megatron_best()
    iv = g.ratio(mine, ref)
    if iv is None or mine is None or ref is None:
        return []
    target = BEST_TARGET.get(world, 0.97)
    out = [
        f"- {where}: pipetrain's best ({mine[1]} {mine[0]}) / Megatron's best ({ref[1]} "
        f"{ref[0]}): {iv}, target ≤ {target}: {verdict(iv, target)}"
    ]
    lk = g.rows[mine].get("limit_key")
    bound = (
        ratio_interval(g.limits[lk], g.steps[ref], resamples=RESAMPLES) if lk in g.limits else None
    )
    if bound is not None:  # no bubble and free transfers: what no schedule of this cut beats
        how = "one CUDA graph" if lk.endswith("/graph") else "eager"
        out.append(
            f"- {where}: its cut's no-pipeline limit ({how}) / Megatron's best: {bound}"
            f" — the bound for any schedule of this cut and these kernels"
        )
    return out


def efficiency_lines(g: Group, where: str) -> list[str]:
    bar = 0.97 if g.n >= 16 else 0.94
    out = []
    for s in ("zbv", "dualpipev"):
        if g.measured((s, "pipetrain")):
            iv = g.efficiency((s, "pipetrain"))
            verdict_s = verdict(iv, bar, higher_is_better=True)
            out.append(f"- {where}: {s} efficiency {_cell(iv) or '-'}, target ≥ {bar}: {verdict_s}")
    return out


def memory_lines(g: Group, where: str) -> list[str]:
    out = []
    for s, lib in g.rows:
        pm = g.peak((s, lib))
        if lib != "pipetrain" or not pm:
            continue
        worse = []
        for s2, other in g.rows:
            om = g.peak((s2, other))
            if s2 == s and not other.startswith("pipetrain") and om:
                gap = max(a - b for a, b in zip(pm, om))
                if gap > 0:
                    worse.append(f"{other} (+{gap:.3f} GiB)")
        verdict_s = "met" if not worse else "missed against " + ", ".join(worse)
        out.append(f"- {where}: {s} peak allocated memory ≤ every incumbent's: {verdict_s}")
    return out


def report(paths: list[Path]) -> str:
    parts = []
    for (device, world, gc), runs in load(paths).items():
        versions = runs[0]["meta"].get("versions", {})
        parts += [f"**{device} × {world}**, gc {gc}, {len(runs)} file(s) ({versions})", ""]
        for g in groups(runs):
            parts += [f"*{g.shape}, {g.n} micro-batches, {world} ranks*", ""]
            parts += [*table(g), "", noise(g), *gc_line(g), *targets(g, world), ""]
    return "\n".join(parts)


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 2:
        sys.exit("usage: python benchmarks/incumbents/incumbents_stats.py LAUNCH.json ...")
    print(report([Path(p) for p in sys.argv[1:]]))
