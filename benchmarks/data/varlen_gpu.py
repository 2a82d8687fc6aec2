"""Length-aware micro-batches against fixed packing on 2 or 4 GPUs: ``pipetrain train --model-dir``
on long-tailed documents, real tokens per second over rotated launches, beside the simulator's
prediction stated before the runs. A benchmark, not a test.

    python benchmarks/data/varlen_gpu.py --gpus 2 --out $OUT                       # 2 GPUs
    python benchmarks/data/varlen_gpu.py --gpus 4 --launcher torchrun --out $OUT   # 4, under torchrun
    python benchmarks/data/varlen_gpu.py --preset cpu-smoke --out /tmp/v           # CPU, gloo, 2 processes

It first writes what the runs share, under ``$VARLEN_WORK`` (default ``/tmp/varlen-gpu``, kept
between calls): a text file of documents whose lengths in tokens are log-normal (shape ``SIGMA``,
median ``seq_len / 8``, one document a line), a Llama-shaped folder of random weights of the
preset's shape (``llama-1b``: 22 layers of 2048, 1.17 B parameters) with a byte-level BPE
tokenizer trained on the text (``packed_tokens_gpu.write_folder``), and a costs file from
``pipetrain profile --model-dir DIR --seq-lens S/4,S/2,S`` (the per-token and per-token²
coefficients the length-aware runs balance by). Then, before any run, it prices every variant's
steps with the simulator and prints them (``varlen_predict``: each planned step's micro-batches,
from the planner the runs' workers call, on the cut ``pipetrain train`` makes by default):

* ``fixed``: ``-m M --microbatch-balance fixed``: every step ``M`` micro-batches of documents
  packed in order (next-fit), the packing every trainer does;
* ``aware``: ``--global-batch-tokens N --costs FILE``: a step is ``N`` real tokens (``N`` the
  fixed run's mean real tokens per step over the same steps, so both train on as many tokens),
  in as many micro-batches as they fill, balanced by the profiled length costs and ordered
  lightest first (``app.data``), each count with its own program;
* ``balanced`` (with ``--variants fixed,aware,balanced``): ``-m M --costs FILE``: the fixed
  count, length-aware: the balance (and the packer filling rows' gaps from the step's whole
  offer) without the token budget, to tell the two apart.

The runs: ``--launches`` rounds (≥ 3 on GPUs), each launching every variant, their order rotated
from one round to the next; each launch is ``pipetrain train`` as a user runs it, a process per
GPU (``--launcher pipetrain``: the command starts them itself; ``torchrun``: under
``torch.distributed.run --standalone``). ``--max-launches K`` stops after K launches, and a later
call with the same ``--out`` keeps the complete ones: for a machine's per-command time limit.
Each run's ``--metrics`` file gives real tokens per second per step (the first ``warmup`` steps
dropped); each variant's ratio over fixed has a 95% interval over launches and steps
(``benchmarks/common/intervals.py``, on seconds per real token), beside its predicted ratio; the
losses of the first round are compared step by step with fixed's (bf16 on GPUs: the issue asks
them within 1% of each other over 50 steps). Writes ``prediction.json`` (before the runs),
``varlen_gpu.json``, the metrics files, the logs and the costs file under ``--out``, and prints
the table.

Pending: issue 52's second item, pipetrain against torchtitan's own trainer on the same model,
data and GPUs, is not in this script.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIGMA = 1.0  # log-normal shape of the document lengths: a long tail past the median
VARIANTS = ("fixed", "aware", "balanced")

PRESETS = {
    # 22 x 2048 Llama, 1.17 B parameters, bf16, rows of 8192 tokens: a 50-step run of 131k
    # tokens a step on 2 GPUs takes about a minute, so a round of launches fits a device call
    "llama-1b": dict(
        hidden=2048,
        layers=22,
        heads=16,
        kv_heads=8,
        ffn=5632,
        vocab=32000,
        seq=8192,
        mbs=2,  # two rows a micro-batch: one row is one document's cost, nothing to balance
        microbatches_per_rank=4,
        schedule="1f1b",
        dtype="bfloat16",
        steps=50,
        warmup=10,
        launches=3,
        documents=12000,  # 20 M tokens: 50 steps on 4 GPUs read about 11 M, one epoch
        device="cuda",
    ),
    "cpu-smoke": dict(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=128,
        vocab=512,
        seq=128,
        mbs=1,
        microbatches_per_rank=2,
        schedule="1f1b",
        dtype="float32",
        steps=3,
        warmup=1,
        launches=1,  # a dry run of every part, not a measurement: one round of two launches
        documents=300,
        device="cpu",
        profile=["--repeats", "1", "--context", "1"],  # a dry run's profile: one timing each
    ),
}


def write_documents(path: Path, count: int, median_words: float, seed: int = 0) -> None:
    """``count`` documents, one a line, of log-normal word counts (median ``median_words``) over
    a Zipf-like vocabulary of made-up words."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(5000)]
    weights = [1 / (i + 1) for i in range(len(words))]
    with path.open("w") as f:
        for _ in range(count):
            n = max(1, round(median_words * rng.lognormvariate(0.0, SIGMA)))
            f.write(" ".join(rng.choices(words, weights, k=n)).capitalize() + ".\n")


def profile_argv(p: dict, folder: Path, costs: Path) -> list[str]:
    """``pipetrain profile``'s arguments for the folder's length costs at the preset's shape."""
    seq = p["seq"]
    argv = ["profile", "--model-dir", str(folder), "--seq-len", str(seq)]
    argv += ["--seq-lens", f"{seq // 4},{seq // 2},{seq}", "--microbatch-size", str(p["mbs"])]
    argv += ["--dtype", p["dtype"], "--device", p["device"], "--out", str(costs)]
    return [*argv, *p.get("profile", [])]


def prepare(p: dict, work: Path, out: Path, given: Path | None = None) -> tuple[Path, Path, Path]:
    """The text, the model folder and the costs file (each written once, then reused; the costs
    file ``given`` instead, when it is)."""
    from benchmarks.data.packed_tokens_gpu import write_folder

    work.mkdir(parents=True, exist_ok=True)
    text, folder, costs = work / "documents.txt", work / "model", work / "costs.json"
    target = p["seq"] / 8
    if not (folder / "config.json").is_file():
        write_documents(text, p["documents"], target)  # a first guess: a token a word
        write_folder(folder, text, p)
        # the tokenizer's tokens per word, then the text again so that its median is the target
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(folder)
        sample = text.read_text().splitlines()[:200]
        per_word = sum(len(tok(x).input_ids) for x in sample) / sum(len(x.split()) for x in sample)
        write_documents(text, p["documents"], target / per_word)
    if given is not None:
        costs = given
    elif not costs.is_file():
        cmd = [sys.executable, "-m", "pipetrain", *profile_argv(p, folder, costs)]
        print(" ".join(cmd[1:]), flush=True)
        with (out / "profile.log").open("w") as log:
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise SystemExit(f"pipetrain profile failed: see {out / 'profile.log'}")
    (out / "costs.json").write_text(costs.read_text())
    return text, folder, costs


def common_flags(p: dict, gpus: int, text: Path, folder: Path, out: Path) -> list[str]:
    """The ``pipetrain train`` flags every variant shares (the data cache beside the text)."""
    flags = ["--model-dir", str(folder), "--data", str(text), "--device", p["device"]]
    flags += ["-p", str(gpus), "-s", p["schedule"], "--seq-len", str(p["seq"])]
    flags += ["--microbatch-size", str(p["mbs"]), "--dtype", p["dtype"], "--steps", str(p["steps"])]
    flags += ["--data-cache", str(text.parent / "data-cache"), "--timeout", "600"]
    return [*flags, "--warmup", "0", "--svg", str(out / "train_step.svg")]


def variant_flags(name: str, p: dict, gpus: int, costs: Path, tokens: int) -> list[str]:
    """The flags that make ``name`` (``VARIANTS``); ``tokens``: the aware run's budget."""
    m = str(p["microbatches_per_rank"] * gpus)
    if name == "fixed":
        return ["-m", m, "--microbatch-balance", "fixed"]
    if name == "balanced":
        return ["-m", m, "--microbatch-balance", "length", "--costs", str(costs)]
    return ["--global-batch-tokens", str(tokens), "--costs", str(costs)]


def predict_all(
    p: dict, gpus: int, variants: list[str], text: Path, folder: Path, costs: Path, out: Path
) -> int:
    """The simulator's prediction for every variant, printed and written before any run; the
    aware run's token budget (the fixed run's mean real tokens per step)."""
    from benchmarks.data.varlen_predict import StepRun, predict
    from pipetrain.app.data import DataOptions, prepare, transformer_cost
    from pipetrain.planner.costs_file import load_costs
    from pipetrain.planner.layout import default_cut
    from pipetrain.planner.varlen import model_length_cost

    model = load_costs(costs)
    # the tokens the runs read: the same cache, tokenized here first if missing
    options = DataOptions(seq_len=p["seq"])
    lengths = prepare(text, folder, options, cache_dir=text.parent / "data-cache").lengths
    cut = default_cut(p["layers"], gpus, first=1, last=2)  # train's: embedding; norm and head
    shape = dict(schedule=p["schedule"], ranks=gpus, seq_len=p["seq"], microbatch_size=p["mbs"])
    shape |= {"steps": p["steps"], "cost": model_length_cost(model)}
    m = p["microbatches_per_rank"] * gpus
    flops = transformer_cost(p["hidden"])  # what a run without --costs plans by
    fixed = predict(
        StepRun(**shape | {"cost": flops}, balanced=False, microbatches=m), lengths, model, cut
    )
    tokens = round(fixed["real_tokens"] / fixed["steps"])
    runs = {
        "fixed": None,
        "balanced": StepRun(**shape, balanced=True, microbatches=m),
        "aware": StepRun(**shape, balanced=True, global_batch_tokens=tokens),
    }
    rows = {
        name: fixed if name == "fixed" else predict(runs[name], lengths, model, cut)
        for name in variants
    }
    record: dict = {name: row for name, row in rows.items()}
    record["ratio"] = {n: rows[n]["tok_per_s"] / fixed["tok_per_s"] for n in variants}
    record["global_batch_tokens"] = tokens
    (out / "prediction.json").write_text(json.dumps(record, indent=1))
    print(f"predicted before the runs (simulator, {p['steps']} steps, costs from {costs}):")
    for name, row in rows.items():
        counts = ", ".join(f"{k} ({v} steps)" for k, v in row["counts"].items())
        print(
            f"  {name:8}: {row['tok_per_s']:>10,.0f} tok/s ({record['ratio'][name]:.3f} x fixed)"
            f"  step {row['step_ms']:8.1f} ms  max/mean micro-batch cost "
            f"{row['max_over_mean']:.3f}  padding {row['padding']:.1%}  micro-batches: {counts}"
        )
    print(f"  (aware: --global-batch-tokens {tokens})", flush=True)
    return tokens


def run_train(name: str, argv: list[str], gpus: int, launcher: str, out: Path) -> list[dict]:
    """One launch of ``pipetrain train``: its metrics lines."""
    metrics = out / f"{name}.metrics.jsonl"
    metrics.unlink(missing_ok=True)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc-per-node", str(gpus), "-m", "pipetrain", "train"]
    else:
        cmd = [sys.executable, "-m", "pipetrain", "train"]
    cmd += [*argv, "--metrics", str(metrics)]
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    with (out / f"{name}.log").open("w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{name}: pipetrain train exited {rc}: see {out / f'{name}.log'}")
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    rate = statistics.median(x["tok_per_s"] for x in lines)
    took = time.perf_counter() - t0
    print(f"{name}: {rate:,.0f} tok/s (median step) in {took:.0f} s", flush=True)
    return lines


def complete(metrics: Path, steps: int) -> list[dict] | None:
    """An earlier call's launch, if it ran all its steps (its metrics lines), else None."""
    if not metrics.is_file():
        return None
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    return lines if len(lines) == steps else None


def rounds(launches: int, variants: list[str]) -> list[tuple[int, str]]:
    """(round, variant) in launch order: every variant each round, the order rotated by one
    from one round to the next."""
    order = []
    for r in range(launches):
        k = r % len(variants)
        order += [(r, name) for name in variants[k:] + variants[:k]]
    return order


def summarise(p: dict, runs: dict[str, list[list[dict]]], out: Path) -> dict:
    """The measured table beside the prediction; ``varlen_gpu.json``."""
    from benchmarks.common.intervals import ratio_interval

    warm = p["warmup"]

    def per_token(lines: list[dict]) -> list[float]:  # seconds per real token, timed steps
        return [1 / x["tok_per_s"] for x in (lines[warm:] or lines)]

    times = {name: [per_token(x) for x in launches] for name, launches in runs.items()}
    predicted = json.loads((out / "prediction.json").read_text())
    rates = {
        name: [statistics.median(1 / t for t in launch) for launch in launches]
        for name, launches in times.items()
    }
    print(f"\n{'variant':9} {'predicted':>10} {'tok/s per launch':>34}  x fixed, 95% interval")
    result: dict = {"preset": p, "prediction": predicted, "measured_tok_per_s": rates}
    result |= {"ratio": {}, "losses": {}}
    base = [x["loss"] for x in runs["fixed"][0]]
    for name in runs:
        speedup = ratio_interval(times["fixed"], times[name])  # fixed's time per token over its
        shown = ", ".join(f"{r:,.0f}" for r in rates[name])
        against = f"{speedup} (predicted {predicted['ratio'][name]:.3f}: it "
        against += f"{where(speedup, predicted['ratio'][name])})"
        print(f"{name:9} {predicted[name]['tok_per_s']:>10,.0f} {shown:>34}  {against}")
        result["ratio"][name] = None if speedup is None else dataclasses.asdict(speedup)
        losses = [x["loss"] for x in runs[name][0]]
        worst = max(abs(a - f) / abs(f) for a, f in zip(losses, base, strict=True))
        result["losses"][name] = {"losses": losses, "largest_difference": worst}
    for name, record in result["losses"].items():
        if name != "fixed":
            worst = record["largest_difference"]
            verdict = "within" if worst <= 0.01 else "NOT within"
            print(
                f"losses of {name} against fixed ({len(base)} steps, first round): largest "
                f"step-wise difference {worst:.2%} ({verdict} 1%)"
            )
    (out / "varlen_gpu.json").write_text(json.dumps(result, indent=1))
    return result


def where(interval, predicted: float) -> str:  # type: ignore[no-untyped-def]
    """Where the predicted ratio lies against the measured interval."""
    if interval is None:
        return "nothing measured"
    if interval.low <= predicted <= interval.high:
        return "inside"
    return "above" if predicted > interval.high else "below"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="llama-1b")
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--gpus", type=int, choices=(2, 4), default=2, help="pipeline ranks (default 2)"
    )
    ap.add_argument("--launcher", choices=("pipetrain", "torchrun"), default="pipetrain")
    ap.add_argument("--launches", type=int, default=None, help="rounds (default: the preset's)")
    ap.add_argument(
        "--variants",
        default="fixed,aware",
        help=f"the runs of a round, fixed first, of {', '.join(VARIANTS)} (default fixed,aware)",
    )
    ap.add_argument(
        "--max-launches",
        type=int,
        default=None,
        help="launch at most this many runs in this call and stop (a later call with the same "
        "--out keeps the complete ones): for a device's per-command time limit",
    )
    ap.add_argument(
        "--costs",
        type=Path,
        default=None,
        help="a costs file of this folder with length costs (pipetrain profile --seq-lens) to "
        "use instead of profiling it now",
    )
    args = ap.parse_args()
    p = PRESETS[args.preset]
    launches = p["launches"] if args.launches is None else args.launches
    variants = args.variants.split(",")
    if launches < 1:
        ap.error("--launches must be >= 1")
    if variants[0] != "fixed" or not set(variants) <= set(VARIANTS) or len(set(variants)) < 2:
        ap.error(f"--variants: fixed first, then one or more of {', '.join(VARIANTS[1:])}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("VARLEN_WORK", "/tmp/varlen-gpu")) / args.preset
    t0 = time.perf_counter()
    text, folder, costs = prepare(p, work, out, args.costs)
    print(f"prepared {work} in {time.perf_counter() - t0:.0f} s", flush=True)
    tokens = predict_all(p, args.gpus, variants, text, folder, costs, out)
    runs: dict[str, list[list[dict]]] = {name: [] for name in variants}
    started = 0
    for round_, name in rounds(launches, variants):
        kept = complete(out / f"{name}-{round_}.metrics.jsonl", p["steps"])
        if kept is not None:
            print(f"{name}-{round_}: kept from an earlier call", flush=True)
            runs[name].append(kept)
            continue
        if args.max_launches is not None and started >= args.max_launches:
            print(f"stopped after {started} launches (--max-launches); call again to go on")
            return
        started += 1
        argv = common_flags(p, args.gpus, text, folder, out)
        argv += variant_flags(name, p, args.gpus, costs, tokens)
        runs[name].append(run_train(f"{name}-{round_}", argv, args.gpus, args.launcher, out))
    summarise(p, runs, out)


if __name__ == "__main__":
    main()
