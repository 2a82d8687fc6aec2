"""Layer rules: schedule, sim and render import only the standard library; the planner never
imports the renderer or the command line; module basenames are unique (docs/design.md)."""

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


def test_planner_and_app_stay_below_the_command_line() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "pipetrain"
    for path in (root / "planner").rglob("*.py"):
        text = path.read_text()
        for banned in ("pipetrain.render", "pipetrain.cli"):
            assert banned not in text, (path, banned)
    for path in (root / "app").rglob("*.py"):
        assert "pipetrain.cli" not in path.read_text(), path


def test_no_two_modules_share_a_basename() -> None:
    from collections import Counter
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "pipetrain"
    names = Counter(p.name for p in root.rglob("*.py") if p.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []
