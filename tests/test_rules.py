"""Layer rules: schedule, sim and render import only the standard library (docs/design.md)."""

from __future__ import annotations

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "numpy"}:
            raise ImportError(f"layer rule broken: {name} imported")
sys.meta_path.insert(0, Block())
import pkgutil, importlib, pipetrain
for pkg in ("pipetrain.schedule", "pipetrain.sim", "pipetrain.render", "pipetrain.planner"):
    mod = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
import pipetrain.cli
pipetrain.cli.main(["compare", "--ranks", "2", "--microbatches", "4"])
print("clean")
"""


def test_pure_layers_import_without_torch() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("clean")


def test_runtime_is_the_only_torch_importer() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "pipetrain"
    for layer in ("schedule", "sim", "render", "planner"):
        for path in (root / layer).rglob("*.py"):
            text = path.read_text()
            assert "import torch" not in text, path
            assert "pipetrain.runtime" not in text, path
    for path in (root / "runtime").rglob("*.py"):
        text = path.read_text()
        for banned in ("pipetrain.sim", "pipetrain.render", "pipetrain.cli"):
            assert banned not in text, (path, banned)
