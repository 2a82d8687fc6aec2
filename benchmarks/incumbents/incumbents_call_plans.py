"""Which parts one GPU call for docs/incumbents.md runs, in which order: the plans as data
(standard library only; ``incumbents_call.py`` runs them).

A *part* is one launch of ``incumbents.py`` (a separate torchrun; ``--launch K`` rotates the
libraries' order) with its own harness budget and timeout, or, for ``exact`` parts, one float64
exactness run of ``gpu_equivalence.py``. Parts run the most needed first, so a call cut short by
its wall budget still answers the main question. Plans (``PLAN``):

* ``issue21`` (2 GPUs, ~525 s): the GPT at 16 micro-batches, 1F1B and interleaved 1F1B:
  pipetrain and pipetrain-nodefer against Megatron's 1F1B without batch sync and every
  interleaved variant (launch 0 sweeps them, launches 1 and 2 run its two fastest); then the
  Llama-3-8B-like stack (8 layers, 8 micro-batches), one launch.
* ``issue21-llama`` (2 GPUs): the Llama shape alone, three launches.
* ``issue21-llama3`` (2 GPUs, ~520 s): the Llama shape's 1F1B, interleaved and ZBV on the
  planner's and on the incumbents' cut (pipetrain-samecut) beside Megatron's, three launches.
* ``issue21-llama-v`` (2 GPUs, ~510 s): the Llama shape's ZBV and DualPipeV (both cuts, limits,
  DeepSpeed's DualPipeV engine), ``LAUNCHES`` launches.
* ``issue21x4`` (4 GPUs, ~530 s): the GPT at 16 and 8 micro-batches, 1F1B, interleaved, ZBV and
  DualPipeV; launch 0 with Python's collector as it is, launches 1 and 2 with it off.
* ``issue21x4b`` (4 GPUs, ~510 s): what issue21x4 left: the 8-micro-batch rows twice and 16 once
  more, Megatron's interleaved variants without warm-up/flush overlap (it hung).
* ``issue21-extra`` / ``issue21x4-extra`` (2 / 4 GPUs): the rows the others leave out: torch's
  zero-bubble rows, DeepSpeed (1F1B, bf16 optimizer, DualPipeV), Megatron 1F1B with batch sync.
* ``issue21-best2`` (2 GPUs, ~430 s, ``TUNED``): pipetrain's 1F1B, interleaved and ZBV beside
  Megatron's best rows; ``issue21-best2g`` (``ALLOC_CONF=``) the same also as CUDA graphs.
* ``issue21-equal`` / ``issue21x4-equal`` (2 / 4 GPUs, ~400 s, ``TUNED``): the equal-kernel rows
  alone; ``issue21-equal-1f1b`` (2 GPUs, ``LAUNCHES=6``): the 1F1B ones, no limits.
* ``issue21-mgraph`` / ``issue21x4-mgraph`` (2 / 4 GPUs, ``ALLOC_CONF= TUNED=``): pipetrain's CUDA
  graph rows against Megatron-Core's full-iteration graph (``SCHEDULES``, ``LIMIT_GRAPH=1``,
  ``VARIANTS``).
* ``issue21x4g`` (4 GPUs, ``TUNED``): the V rows and interleaved 1F1B eager and as CUDA graphs.
* older: ``issue13`` (the default, the 4-GPU list), ``leads2``, ``confirm2``, ``full2`` (2 GPUs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

#: every schedule family the older full tables run
ALL = "1f1b,interleaved-1f1b,zbv,dualpipev,interleaved-zb"


@dataclass(frozen=True)
class Part:
    """One launch of the call. ``budget_s`` is the harness's ``--budget-s`` (it starts a row only
    if the longest so far still fits), ``limit_s`` the part's timeout; ``None`` for both: whatever
    the call has left. ``exact``: a float64 exactness run, skipped unless its whole timeout fits."""

    name: str
    nproc: int
    budget_s: int | None
    limit_s: int | None
    args: tuple[str, ...] = ()
    exact: bool = False


@dataclass(frozen=True)
class Settings:
    """What the environment sets: shape names (tiny ones on a CPU check), timed steps, the
    "4-rank" parts' process count, the launch series, and the earlier launch 0 (``TUNED``)."""

    gpt: str = "gpt"
    wide: str = "wide"
    blocks: str = "blocks"
    llama: str = "llama"
    steps: int = 20
    nproc4: int = 4
    launches: int = 3
    first_launch: int = 0
    tuned: str = ""
    schedules: str = ""
    limit_graph: bool = False
    variants: str = ""
    shape: str = ""
    work: str = "/tmp/incumbents"

    @classmethod
    def from_env(cls, env: Mapping[str, str], work: str) -> Settings:
        def number(key: str, default: int) -> int:
            value = env.get(key, "") or str(default)
            if not value.isdigit():
                raise ValueError(f"{key}={value!r}: a whole number of at least 0")
            return int(value)

        return cls(
            gpt=env.get("GPT", "gpt"),
            wide=env.get("WIDE", "wide"),
            blocks=env.get("BLOCKS", "blocks"),
            llama=env.get("LLAMA", "llama"),
            steps=number("STEPS", 20),
            nproc4=number("NPROC4", 4),
            launches=number("LAUNCHES", 3),
            first_launch=number("FIRST_LAUNCH", 0),
            tuned=env.get("TUNED", ""),
            schedules=env.get("SCHEDULES", ""),
            limit_graph=bool(env.get("LIMIT_GRAPH", "")),
            variants=env.get("VARIANTS", ""),
            shape=env.get("SHAPE", ""),
            work=work,
        )

    def c21(self) -> list[str]:
        """Issue 21's common settings: timed steps, pipetrain with and without deferred weight
        gradients, no timeline step (diagnostics cost device time), torch rows only where asked."""
        return words(
            f"--steps {self.steps} --warmup 2 --timeline-steps 0 --variants nodefer"
            " --torch-schedules none"
        )

    def tuned_from(self, first: str) -> list[str]:
        """Launches 1 and 2 pick Megatron's fastest interleaved rows from an earlier launch 0:
        ``TUNED``, else this call's part ``first``."""
        source = self.tuned or f"{self.work}/{first}/incumbents.json"
        return ["--libraries", "megatron-nosync,megatron-tuned", "--megatron-tuned-from", source]

    def required_tuned(self) -> str:
        if not self.tuned:
            raise ValueError(
                "this plan needs TUNED: launch-0 incumbents.json files, comma-separated"
            )
        return self.tuned


def words(text: str) -> list[str]:
    return text.split()


def launches(
    s: Settings, letter: str, what: str, nproc: int, budget: int, limit: int, args: list[str]
) -> list[Part]:
    """One part in ``s.launches`` launches, the libraries' order rotated, numbered from
    ``s.first_launch`` (a later call continues a pooled series): ``<letter>1-<what>-l0``, ..."""
    first = s.first_launch
    return [
        Part(f"{letter}{k + 1}-{what}-l{k}", nproc, budget, limit, ("--launch", str(k), *args))
        for k in range(first, first + s.launches)
    ]


def issue21(s: Settings) -> list[Part]:
    g = words(f"--shapes {s.gpt} --microbatches 16 --schedules 1f1b,interleaved-1f1b")
    g += [*words("--limit-schedules none"), *s.c21(), "--plan", "issue21"]
    sweep = ["--libraries", "megatron-nosync,megatron-sweep,megatron-gaf"]
    llama = words(f"--shapes {s.llama} --microbatches 8 --schedules 1f1b,interleaved-1f1b")
    llama += [*words("--limit-schedules none"), *s.c21(), "--plan", "issue21"]
    return [
        Part("i1-gpt16-l0", 2, 170, 210, ("--launch", "0", *g, *sweep)),
        Part("i2-gpt16-l1", 2, 75, 110, ("--launch", "1", *g, *s.tuned_from("i1-gpt16-l0"))),
        Part("i3-gpt16-l2", 2, 75, 110, ("--launch", "2", *g, *s.tuned_from("i1-gpt16-l0"))),
        Part(
            "i4-llama8-l0",
            2,
            125,
            165,
            ("--launch", "0", *llama, "--libraries", "megatron-nosync,megatron-sweep"),
        ),
    ]


def issue21_llama(s: Settings) -> list[Part]:
    lm = words(f"--shapes {s.llama} --microbatches 8 --schedules 1f1b,interleaved-1f1b")
    lm += [*words("--limit-schedules none"), *s.c21(), "--plan", "issue21-llama"]
    sweep = ["--libraries", "megatron-nosync,megatron-sweep,megatron-gaf"]
    return [
        Part("j1-llama8-l0", 2, 125, 165, ("--launch", "0", *lm, *sweep)),
        Part("j2-llama8-l1", 2, 110, 150, ("--launch", "1", *lm, *s.tuned_from("j1-llama8-l0"))),
        Part("j3-llama8-l2", 2, 110, 150, ("--launch", "2", *lm, *s.tuned_from("j1-llama8-l0"))),
    ]


def issue21_llama3(s: Settings) -> list[Part]:
    """The Llama shape, three launches: pipetrain's 1F1B, interleaved and ZBV on the planner's
    cut and on the incumbents' (pipetrain-samecut: memory at equal layers per rank), beside
    Megatron's 1F1B and its interleaved variants without warm-up/flush overlap."""
    lm = words(f"--shapes {s.llama} --microbatches 8 --schedules 1f1b,interleaved-1f1b,zbv")
    lm += words(f"--limit-schedules zbv --plan issue21-llama3 --steps {s.steps} --warmup 3")
    lm += words("--timeline-steps 0 --torch-schedules none --variants samecut --gc manual")
    sweep = ["--libraries", "megatron-nosync,megatron-sweep-nowf"]
    return [
        Part("k1-llama8-l0", 2, 150, 185, ("--launch", "0", *lm, *sweep)),
        Part("k2-llama8-l1", 2, 130, 165, ("--launch", "1", *lm, *s.tuned_from("k1-llama8-l0"))),
        Part("k3-llama8-l2", 2, 130, 165, ("--launch", "2", *lm, *s.tuned_from("k1-llama8-l0"))),
    ]


def issue21_llama_v(s: Settings) -> list[Part]:
    lm = words(f"--shapes {s.llama} --microbatches 8 --schedules zbv,dualpipev")
    lm += words(f"--limit-schedules zbv,dualpipev --plan issue21-llama-v --steps {s.steps}")
    lm += words("--warmup 3 --timeline-steps 0 --torch-schedules none --variants samecut")
    lm += words("--gc manual --libraries deepspeed-dualpipev")
    return launches(s, "v", "llama8", 2, 130, 165, lm)


def issue21x4(s: Settings) -> list[Part]:
    """Launch 0 with the collector on (each step's pauses recorded; a trace of interleaved 1F1B
    with and without deferral), launches 1 and 2 with it off for every library."""
    x = words(
        f"--shapes {s.gpt} --microbatches 16,8 --schedules 1f1b,interleaved-1f1b,zbv,dualpipev"
    )
    x += words("--limit-schedules zbv,dualpipev --plan issue21x4")
    sweep = words("--gc python --libraries megatron-nosync,megatron-sweep,megatron-gaf --profile")
    sweep += ["pipetrain:interleaved-1f1b,pipetrain-nodefer:interleaved-1f1b"]
    later = [*s.c21(), "--gc", "manual", *s.tuned_from("x1-gpt-l0")]
    n = s.nproc4
    return [
        Part("x1-gpt-l0", n, 190, 225, ("--launch", "0", *x, *s.c21(), *sweep)),
        Part("x2-gpt-l1", n, 125, 160, ("--launch", "1", *x, *later)),
        Part("x3-gpt-l2", n, 125, 160, ("--launch", "2", *x, *later)),
    ]


def issue21x4b(s: Settings) -> list[Part]:
    """What issue21x4 left (its launch 0 hung in Megatron's warm-up/flush overlap at 4 ranks, and
    the 8-micro-batch rows ran out of time), collector off."""
    x = words(f"--shapes {s.gpt} --schedules 1f1b,interleaved-1f1b,zbv,dualpipev")
    x += [*words("--limit-schedules zbv,dualpipev --plan issue21x4 --gc manual"), *s.c21()]
    nowf = ["--libraries", "megatron-nosync,megatron-sweep-nowf"]
    n = s.nproc4
    return [
        Part("y1-gpt8-l0", n, 150, 185, ("--launch", "0", "--microbatches", "8", *x, *nowf)),
        Part("y2-gpt16-l1", n, 160, 195, ("--launch", "1", "--microbatches", "16", *x, *nowf)),
        Part(
            "y3-gpt8-l2",
            n,
            95,
            130,
            ("--launch", "2", "--microbatches", "8", *x, *s.tuned_from("y1-gpt8-l0")),
        ),
    ]


def _extra(s: Settings, plan: str) -> tuple[list[str], list[str], list[str]]:
    """The ``*-extra`` plans' rows: the common arguments, then torch's zero-bubble rows and
    DeepSpeed's DualPipeV beside pipetrain's and the limit, then DeepSpeed's 1F1B (fp32 and bf16
    optimizer), torch's 1F1B and Megatron's with and without batch sync beside pipetrain's."""
    e = words(f"--launch 0 --shapes {s.gpt} --microbatches 16 --limit-schedules zbv,dualpipev")
    e += words(f"--plan {plan} --steps {s.steps} --warmup 2 --timeline-steps 0")
    zb = "zb-h1,interleaved-zb,zbv,dualpipev"
    zero_bubble = ["--schedules", zb, "--libraries", "deepspeed-dualpipev", "--torch-schedules", zb]
    ds = words("--schedules 1f1b --libraries megatron,megatron-nosync,deepspeed,deepspeed-bf16")
    ds += words("--torch-schedules 1f1b --variants nodefer")
    return e, zero_bubble, ds


def issue21_extra(s: Settings) -> list[Part]:
    e, zero_bubble, ds = _extra(s, "issue21-extra")
    lm = words(f"--launch 0 --shapes {s.llama} --microbatches 8 --steps {s.steps} --warmup 2")
    lm += words("--timeline-steps 0 --schedules zbv,dualpipev --limit-schedules zbv,dualpipev")
    lm += words("--libraries deepspeed-dualpipev --torch-schedules zbv,dualpipev")
    return [
        Part("e1-zb", 2, 150, 190, (*e, *zero_bubble)),
        Part("e2-ds", 2, 120, 160, (*e, *ds)),
        Part("e3-llama-v", 2, 120, 160, (*lm, "--plan", "issue21-extra")),
    ]


def issue21x4_extra(s: Settings) -> list[Part]:
    e, zero_bubble, ds = _extra(s, "issue21x4-extra")
    return [
        Part("f1-zb", s.nproc4, 170, 210, (*e, *zero_bubble)),
        Part("f2-ds", s.nproc4, 140, 180, (*e, *ds)),
    ]


def issue21_best2(s: Settings) -> list[Part]:
    """pipetrain's ZBV (with its no-pipeline limit) beside Megatron's best rows (1F1B without
    batch sync, the fastest interleaved variant of ``TUNED``) in the same launches, rotated."""
    b = words(f"--shapes {s.gpt} --microbatches 16 --schedules 1f1b,interleaved-1f1b,zbv")
    b += words(f"--limit-schedules zbv --plan issue21-best2 --steps {s.steps} --warmup 2")
    b += words("--timeline-steps 0 --torch-schedules none")
    b += words("--libraries megatron-nosync,megatron-tuned --megatron-top 1 --megatron-tuned-from")
    return launches(s, "b", "gpt16", 2, 110, 145, [*b, s.required_tuned()])


def issue21_best2g(s: Settings) -> list[Part]:
    """issue21-best2 with pipetrain's interleaved 1F1B and ZBV also as one CUDA graph, every
    library on the allocator's default segments (``ALLOC_CONF=``)."""
    b = words(f"--shapes {s.gpt} --microbatches 16 --schedules interleaved-1f1b,zbv")
    b += words(f"--limit-schedules zbv --plan issue21-best2g --steps {s.steps} --warmup 3")
    b += words("--timeline-steps 0 --torch-schedules none --variants graph --gc manual")
    b += words("--libraries megatron-tuned --megatron-top 1 --megatron-tuned-from")
    return launches(s, "c", "gpt16", 2, 105, 135, [*b, s.required_tuned()])


def issue21_equal(s: Settings, plan: str, nproc: int) -> list[Part]:
    """The equal-kernel rows alone: pipetrain and pipetrain-nodefer beside Megatron's 1F1B
    without batch sync and its fastest interleaved variant of ``TUNED``, collector off."""
    e = words(f"--shapes {s.gpt} --microbatches 16 --schedules 1f1b,interleaved-1f1b --plan {plan}")
    e += words(f"--steps {s.steps} --warmup 3 --timeline-steps 0 --torch-schedules none")
    e += words("--variants nodefer --gc manual --libraries megatron-nosync,megatron-tuned")
    e += ["--megatron-top", "1", "--megatron-tuned-from", s.required_tuned()]
    return launches(s, "e", "gpt16", nproc, 110, 145, e)


def issue21_equal_1f1b(s: Settings) -> list[Part]:
    """The 1F1B equal-kernel rows alone, no limit rows, for a narrower interval (LAUNCHES=6)."""
    f = words(f"--shapes {s.gpt} --microbatches 16 --schedules 1f1b --limit-schedules none")
    f += words(f"--plan issue21-equal-1f1b --steps {s.steps} --warmup 3 --timeline-steps 0")
    f += words("--torch-schedules none --variants nodefer --gc manual --libraries megatron-nosync")
    return launches(s, "f", "gpt16", 2, 80, 105, f)


def issue21_mgraph(s: Settings, plan: str, nproc: int) -> list[Part]:
    """Whole-step CUDA graphs on both sides: pipetrain-graph against Megatron-Core's
    full-iteration graph (megatron-*-graph), with ZBV's limit (``LIMIT_GRAPH``: as a graph)."""
    schedules = s.schedules or "1f1b,interleaved-1f1b,zbv"
    m = words(f"--shapes {s.gpt} --microbatches 16 --schedules {schedules} --limit-schedules zbv")
    m += ["--limit-graph"] if s.limit_graph else []
    m += words(f"--plan {plan} --steps {s.steps} --warmup 3 --timeline-steps 0")
    m += words(f"--torch-schedules none --variants {s.variants or 'graph'} --gc manual")
    m += words("--megatron-top 1 --libraries")
    m += ["megatron-nosync,megatron-nosync-graph,megatron-tuned,megatron-tuned-graph"]
    m += ["--megatron-tuned-from", s.required_tuned()]
    return launches(s, "m", "gpt16", nproc, 150, 185, m)


def issue21x4g(s: Settings) -> list[Part]:
    """The V rows eager and as one CUDA graph, their limits, and Megatron's best interleaved
    variant of ``TUNED``, 16 then 8 micro-batches, three launches rotated."""
    g = words(f"--shapes {s.gpt} --schedules zbv,dualpipev,interleaved-1f1b")
    g += words(f"--limit-schedules zbv,dualpipev --plan issue21x4g --steps {s.steps} --warmup 3")
    g += words("--timeline-steps 0 --torch-schedules none --variants graph --gc manual")
    g += words("--libraries megatron-tuned --megatron-top 1")
    g += ["--megatron-tuned-from", s.required_tuned()]
    parts = []
    for k in range(3):
        for m, budget, limit in ((16, 120, 150), (8, 90, 120)):
            name = f"g{len(parts) + 1}-gpt{m}-l{k}"
            args = ("--launch", str(k), "--microbatches", str(m), *g)
            parts.append(Part(name, s.nproc4, budget, limit, args))
    return parts


def leads2(s: Settings) -> list[Part]:
    """Receives posted late (``receive_lead=0|1``, rows pipetrain-leadN) against pipetrain's
    default and Megatron-Core, then the 8-micro-batch V rows and a profile."""
    lead = words("--receive-leads 0,1 --torch-schedules none")
    q4 = words(f"--shapes {s.gpt} --microbatches 16 --schedules interleaved-1f1b --libraries none")
    q4 += words("--torch-schedules none --receive-leads 1 --timeline-steps 0 --profile")
    q4 += ["pipetrain-lead1:interleaved-1f1b,pipetrain:interleaved-1f1b"]
    return [
        Part(
            "q1-gpt16",
            2,
            120,
            150,
            (
                *words(f"--shapes {s.gpt} --microbatches 16 --schedules interleaved-1f1b,1f1b"),
                *words("--libraries megatron,megatron-nosync"),
                *lead,
            ),
        ),
        Part(
            "q2-blocks16",
            2,
            120,
            150,
            (
                *words(f"--shapes {s.blocks} --microbatches 16"),
                *words("--schedules interleaved-1f1b,zbv,dualpipev --libraries megatron"),
                *lead,
            ),
        ),
        Part(
            "q3-v8",
            2,
            110,
            140,
            (
                *words(f"--shapes {s.gpt},{s.blocks} --microbatches 8"),
                *words("--schedules zbv,dualpipev,interleaved-1f1b --libraries megatron"),
                *lead,
            ),
        ),
        Part("q4-prof", 2, 40, 90, tuple(q4)),
    ]


def confirm2(s: Settings) -> list[Part]:
    """The default ``receive_lead=1`` against receives where lowering puts them (rows
    pipetrain-leadnone) and Megatron-Core: the wide shape, then the interleaved rows again."""
    lead = words("--receive-leads none --torch-schedules none --libraries megatron")
    both = f"{s.blocks},{s.gpt}"
    return [
        Part(
            "c1-wide16",
            2,
            150,
            180,
            (
                *words(
                    f"--shapes {s.wide} --microbatches 16 --schedules interleaved-1f1b,zbv,dualpipev,1f1b"
                ),
                *lead,
            ),
        ),
        Part(
            "c2-wide8",
            2,
            100,
            130,
            (
                *words(
                    f"--shapes {s.wide} --microbatches 8 --schedules interleaved-1f1b,zbv,dualpipev"
                ),
                *lead,
            ),
        ),
        Part(
            "c3-il8",
            2,
            90,
            120,
            (*words(f"--shapes {both} --microbatches 8 --schedules interleaved-1f1b"), *lead),
        ),
        Part(
            "c4-il16",
            2,
            100,
            130,
            (
                *words(f"--shapes {both} --microbatches 16 --schedules interleaved-1f1b --steps 8"),
                *lead,
            ),
        ),
    ]


def full2(s: Settings) -> list[Part]:
    """One shape's whole table (``SHAPE``, default the GPT): every library and family."""
    shape = s.shape or s.gpt
    args = ("--shapes", shape, "--microbatches", "16,8", "--schedules", ALL)
    return [Part(f"g2-{shape}", 2, 250, 290, args)]


def issue13(s: Settings) -> list[Part]:
    """The older default, the 4-GPU list: every library and family on the wide shape, profiles,
    float64 exactness on NCCL, the block stack at 2 ranks, then the wide shape at 2 ranks in
    whatever time is left (not when the "4-rank" parts already ran on 2)."""
    n = s.nproc4
    prof = words(f"--shapes {s.gpt} --microbatches 16 --schedules interleaved-1f1b --libraries")
    prof += words("megatron --torch-schedules none --timeline-steps 0 --profile")
    prof += ["megatron-v2:interleaved-1f1b,pipetrain:interleaved-1f1b"]
    parts = [
        Part(
            "p1-wide4",
            n,
            175,
            215,
            ("--shapes", s.wide, "--microbatches", "16,8", "--schedules", ALL),
        ),
        Part("p2-prof4", n, 45, 100, tuple(prof)),
        Part("p2e-exact4", n, None, 60, exact=True),
        Part(
            "p3-blocks2",
            2,
            150,
            180,
            ("--shapes", s.blocks, "--microbatches", "16,8", "--schedules", ALL),
        ),
    ]
    if n != 2:
        wide2 = ("--shapes", s.wide, "--microbatches", "8,16", "--steps", "4", "--schedules", ALL)
        parts.append(Part("p4-wide2", 2, None, None, wide2))
    return parts


#: every plan by its ``PLAN`` name
PLANS: dict[str, Callable[[Settings], list[Part]]] = {
    "issue21": issue21,
    "issue21-llama": issue21_llama,
    "issue21-llama3": issue21_llama3,
    "issue21-llama-v": issue21_llama_v,
    "issue21x4": issue21x4,
    "issue21x4b": issue21x4b,
    "issue21-extra": issue21_extra,
    "issue21x4-extra": issue21x4_extra,
    "issue21-best2": issue21_best2,
    "issue21-best2g": issue21_best2g,
    "issue21-equal": lambda s: issue21_equal(s, "issue21-equal", 2),
    "issue21x4-equal": lambda s: issue21_equal(s, "issue21x4-equal", s.nproc4),
    "issue21-equal-1f1b": issue21_equal_1f1b,
    "issue21-mgraph": lambda s: issue21_mgraph(s, "issue21-mgraph", 2),
    "issue21x4-mgraph": lambda s: issue21_mgraph(s, "issue21x4-mgraph", s.nproc4),
    "issue21x4g": issue21x4g,
    "leads2": leads2,
    "confirm2": confirm2,
    "full2": full2,
    "issue13": issue13,
}


def plan(name: str, settings: Settings) -> list[Part]:
    """The parts of plan ``name``, in the order they run."""
    if name not in PLANS:
        raise ValueError(f"PLAN={name!r}: one of {', '.join(PLANS)}")
    return PLANS[name](settings)
