"""``pipetrain train`` under torchrun: two torchrun agents on the loopback address, 2 processes
each, train to the same losses, bit for bit, as the own launcher's one-machine run of the same
flags (pp 4, and pp 2 × dp 2); rank 0's checks refuse a job whose process count the flags do
not give, on every process, with exit status 2. Without processes: the mesh's pp-major order,
the tensor-parallel span warning, and how a process knows torchrun started it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_harness import free_port

torch = pytest.importorskip("torch")

from pipetrain.app.config import TrainConfig  # noqa: E402
from pipetrain.app.processes import LAUNCHER_PID  # noqa: E402
from pipetrain.app.torchrun import (  # noqa: E402
    check_world_size,
    tensor_parallel_warning,
    under_torchrun,
)

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "gpt", "--layers", "4", "--hidden", "16", "--heads", "2", "--seq-len", "16"]
TINY += ["--steps", "2", "--microbatches", "2", "--microbatch-size", "1", "--timeout", "60"]
LAYOUTS = {"pp4": ["--ranks", "4"], "pp2xdp2": ["--ranks", "2", "--dp", "2"]}


def _env() -> dict[str, str]:
    """This test's environment, less anything a launcher around pytest set."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"OMP_NUM_THREADS": "1"}


def _flags(tmp_path: Path, name: str, layout: list[str]) -> list[str]:
    """The run's flags, its files under ``tmp_path/name`` (metrics in ``name.jsonl``)."""
    out = tmp_path / name
    out.mkdir()
    files = ["--corpus-out", str(tmp_path / "corpus.txt"), "--svg", str(out / "s.svg")]
    return [*TINY, *layout, *files, "--metrics", str(tmp_path / f"{name}.jsonl")]


def _agents(flags: list[str], nproc: int = 2, nodes: int = 2) -> list[subprocess.Popen[str]]:
    """``nodes`` torchrun agents on the loopback address (as on ``nodes`` machines), each
    starting ``nproc`` processes of ``pipetrain train flags``."""
    port = str(free_port())
    procs = []
    for node in range(nodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
        cmd += ["--node-rank", str(node), "--nproc-per-node", str(nproc)]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", port]
        cmd += ["-m", "pipetrain", "train", *flags]
        procs.append(_start(cmd))
    return procs


def _start(cmd: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def _finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -1, out
    return proc.returncode, out


def _losses(metrics: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_two_torchrun_agents_train_as_one_machine_does_bit_for_bit(tmp_path: Path) -> None:
    runs: dict[str, list[subprocess.Popen[str]]] = {}
    for name, layout in LAYOUTS.items():  # all four jobs at once: the cores are shared anyway
        runs[f"{name}-torchrun"] = _agents(_flags(tmp_path, f"{name}-torchrun", layout))
        own = [sys.executable, "-m", "pipetrain", "train"]
        runs[f"{name}-own"] = [_start([*own, *_flags(tmp_path, f"{name}-own", layout)])]
    ended = {name: [_finish(p) for p in procs] for name, procs in runs.items()}
    for name, results in ended.items():
        for status, out in results:
            assert status == 0, f"{name}:\n{out}"
    lead = ended["pp2xdp2-torchrun"][0][1]
    assert "torchrun started 4 processes: 2 pipeline × 2 data parallel × 1 tensor parallel" in lead
    for name in LAYOUTS:
        mine = _losses(tmp_path / f"{name}-torchrun.jsonl")
        reference = _losses(tmp_path / f"{name}-own.jsonl")
        assert len(mine) == 2 and mine == reference, (name, mine, reference)


def test_a_process_count_the_flags_do_not_give_is_refused_on_every_machine(
    tmp_path: Path,
) -> None:
    """Two machines of one process each, for flags that need 4: rank 0's checks refuse it, and
    each machine's process says so in the same line and exits 2."""
    flags = _flags(tmp_path, "refused", ["--ranks", "2", "--dp", "2"])
    line = (
        "pipetrain train: error: torchrun started 2 processes (--nnodes × --nproc-per-node), "
        "but --ranks 2 × --tp 1 × --dp 2 needs 4: start 4 processes or change the flags"
    )
    for status, out in [_finish(p) for p in _agents(flags, nproc=1, nodes=2)]:
        assert status != 0 and out.count(line) == 1, out
        assert "exitcode  : 2" in out, out  # torchrun's report of the process's own status


def test_world_size_and_tensor_parallel_span_checks() -> None:
    config = TrainConfig(ranks=2, dp=2)
    check_world_size(config, 4, 4)
    with pytest.raises(ValueError, match="torchrun started 8 processes .* needs 4"):
        check_world_size(config, 4, 8)
    assert tensor_parallel_warning(tp=2, local=4, world=8) == ""
    assert tensor_parallel_warning(tp=4, local=4, world=8) == ""
    assert tensor_parallel_warning(tp=1, local=3, world=6) == ""
    assert tensor_parallel_warning(tp=3, local=3, world=3) == ""
    assert "--tp 4 does not divide the 2 processes per machine" in tensor_parallel_warning(
        tp=4, local=2, world=8
    )


def test_the_mesh_is_pp_major_with_tp_innermost(monkeypatch) -> None:
    """``app.train`` asks for ``("pp", "dp", "tp")`` (the sizes in that order), and the replica
    that slices the data is the mesh's ``dp`` coordinate."""
    import torch.distributed.device_mesh as device_mesh

    from pipetrain.app.train import _placement
    from pipetrain.app.train_checks import check_arguments

    asked = []

    class Mesh:
        def get_local_rank(self, name: str) -> int:
            return {"pp": 1, "dp": 2, "tp": 0}[name]

    def init_device_mesh(kind, sizes, mesh_dim_names):
        asked.append((kind, sizes, mesh_dim_names))
        return Mesh()

    monkeypatch.setattr(device_mesh, "init_device_mesh", init_device_mesh)
    config = TrainConfig(ranks=2, dp=3, tp=2, data_parallel="fsdp", worker=True)
    placement, replica = _placement(config, check_arguments(config), torch.device("cpu"))
    assert asked == [("cpu", (2, 3, 2), ("pp", "dp", "tp"))] and replica == 2
    assert placement["data_parallel"] == "fsdp"


def test_torchrun_is_recognised_by_its_environment_and_never_in_the_own_launchers_workers(
    monkeypatch,
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv(LAUNCHER_PID, raising=False)
    assert not under_torchrun(TrainConfig())
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert under_torchrun(TrainConfig())
    assert not under_torchrun(TrainConfig(worker=True))
    monkeypatch.setenv(LAUNCHER_PID, "1")
    assert not under_torchrun(TrainConfig())
