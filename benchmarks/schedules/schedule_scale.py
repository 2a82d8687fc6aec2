"""The schedules at scale: build + lower + validate + simulate of 1F1B and ZBV at 128 ranks ×
1,024 micro-batches, against the targets (under 2 s and 5 s of CPU, under 1 GiB).

Each case runs in a fresh process (so its peak resident memory, ``ru_maxrss``, is its own), in
CPU seconds (``time.process_time``: what one core spends, which a shared machine inflates least)
beside wall seconds, best of ``--repeat`` by CPU; the phases are ``schedule_build.py``'s::

    python benchmarks/schedules/schedule_scale.py [--repeat N] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout
from benchmarks.schedules.schedule_build import environment, time_pipetrain

SCALE_CASES = (("1f1b", 128, 1024, 2.0), ("zbv", 128, 1024, 5.0))
SCALE_MIB = 1024


def scale_case(name: str, ranks: int, microbatches: int, repeat: int) -> dict[str, object]:
    """One scale case in this process: phases in CPU and wall seconds (best run by CPU), and
    the process's peak resident memory."""
    import resource

    best: dict[str, dict[str, float]] | None = None
    for _ in range(repeat):
        gc.collect()
        cpu = time_pipetrain(name, ranks, microbatches, time.process_time)
        # the same run's wall time, phase by phase, needs a second clock read per step; one
        # more run with the wall clock keeps the CPU run undisturbed
        wall = time_pipetrain(name, ranks, microbatches, time.perf_counter)
        run = {"cpu": cpu.phases, "wall": wall.phases}
        if best is None or sum(cpu.phases.values()) < sum(best["cpu"].values()):
            best = run
    assert best is not None
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    return {
        "schedule": name,
        "ranks": ranks,
        "microbatches": microbatches,
        **best,
        "peak_mib": peak_mib,
    }


def run_scale(repeat: int) -> list[dict[str, object]]:
    """Each scale case in a fresh interpreter (its own ``ru_maxrss``), nothing else imported."""
    import subprocess

    results = []
    for name, ranks, microbatches, _ in SCALE_CASES:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--scale-case",
                name,
                str(ranks),
                str(microbatches),
                "--repeat",
                str(repeat),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def scale_markdown(results: list[dict[str, object]]) -> str:
    lines = [
        "| schedule | ranks × micro-batches | CPU s (build / lower / validate / simulate) "
        "| wall s | peak RSS MiB | target |",
        "|---|---|---|---|---|---|",
    ]
    for r, (_, _, _, limit) in zip(results, SCALE_CASES):
        cpu, wall = r["cpu"], r["wall"]
        assert isinstance(cpu, dict) and isinstance(wall, dict)
        total, peak = sum(cpu.values()), float(r["peak_mib"])  # type: ignore[arg-type]
        ok = total < limit and peak < SCALE_MIB
        lines.append(
            f"| {r['schedule']} | {r['ranks']} × {r['microbatches']} | **{total:.2f}** ("
            + " / ".join(f"{v:.2f}" for v in cpu.values())
            + f") | {sum(wall.values()):.2f} | {peak:.0f} | < {limit:g} s CPU, "
            f"< {SCALE_MIB} MiB: {'met' if ok else 'MISSED'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs per case, best kept (default: 3)"
    )
    parser.add_argument(
        "--scale-case", nargs=3, metavar=("NAME", "RANKS", "MB"), help=argparse.SUPPRESS
    )
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.scale_case:
        name, ranks, mb = args.scale_case
        print(json.dumps(scale_case(name, int(ranks), int(mb), args.repeat)))
        return 0
    results = run_scale(args.repeat)
    env = environment("process_time and perf_counter", args.repeat)
    print(f"{env['date']}, Python {env['python']}, {env['cpus']} CPUs, best of {args.repeat}\n")
    print(scale_markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "scale": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
