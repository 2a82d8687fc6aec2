"""``moe_overlap_gpu.py --profile``: per row, warm-up steps, then one step under ``torch.profiler``;
each rank's trace reduced to its exposed all-to-all (``moe_overlap_trace``), and the hidden share
of the overlapping row against the same schedule without overlap."""

from __future__ import annotations

from pathlib import Path

from benchmarks.moe.moe_overlap_report import OVERLAP_ROW, PLAIN_ROW
from benchmarks.moe.moe_overlap_run import Run, guarded, optimizer
from benchmarks.moe.moe_overlap_trace import exposed_all_to_all, hidden_share, load_trace


def profile_row(run: Run, row: str, traces: Path) -> dict:
    """Warm-up steps, then one step under ``torch.profiler``; this rank's trace reduced to its
    exposed all-to-all (``moe_overlap_trace``), every rank's gathered."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if run.cuda else [])
    with run.pipeline(row) as pipe:
        opt = optimizer(pipe.parameters())
        for _ in range(max(run.shape.warmup, 1)):
            pipe.step(run.ids, run.ids)
            opt.step()
            opt.zero_grad(set_to_none=False)
        run.sync()
        run.barrier()
        with profile(activities=activities) as prof:
            pipe.step(run.ids, run.ids)
            run.sync()
    path = traces / f"{row.replace('+', '-')}-r{run.rank}.json.gz"
    prof.export_chrome_trace(str(path))
    mine = exposed_all_to_all(load_trace(path))
    missed = mine["source"] == "gpu" and run.shape.ep > 1 and not mine["all_to_all_kernels"]
    # rank 0's two DualPipeV traces are kept (what a missed target is read from), and any trace
    # whose all-to-all kernels were not found
    keep = run.args.keep_traces or missed or (run.rank == 0 and row in (OVERLAP_ROW, PLAIN_ROW))
    if not keep:
        path.unlink()
    ranks = run.gather(mine)
    blind = [
        r
        for r, got in enumerate(ranks)
        if got["source"] == "gpu" and not got.get("all_to_all_kernels")
    ]
    if run.shape.ep > 1 and blind:  # every rank raises alike (guarded gathers the error)
        raise RuntimeError(
            f"no all-to-all kernel found in the traces of ranks {blind} (kept under "
            f"{traces}): moe_overlap_trace's classification missed them"
        )
    return {"ranks": ranks, "source": mine["source"]}


def profile_mode(run: Run, rows: list[str], out: Path) -> tuple[dict, str]:
    traces = out / "traces"
    traces.mkdir(parents=True, exist_ok=True)
    result = {row: guarded(run, row, lambda row=row: profile_row(run, row, traces)) for row in rows}
    plain = result.get(PLAIN_ROW, {}).get("ranks")
    over = result.get(OVERLAP_ROW, {}).get("ranks")
    if plain and over:
        share = hidden_share([r["exposed_ms"] for r in over], [r["exposed_ms"] for r in plain])
        result[OVERLAP_ROW]["hidden_share"] = share
    for got in result.values():  # the all-to-all the step's device time exposes (GPU only)
        ranks = got.get("ranks") or []
        if ranks and all("span_ms" in r for r in ranks):
            got["exposed_share_of_step"] = sum(r["exposed_ms"] for r in ranks) / sum(
                r["span_ms"] for r in ranks
            )
    sources = {r.get("source") for r in result.values() if "source" in r}
    return result, ", ".join(sorted(s for s in sources if s))
