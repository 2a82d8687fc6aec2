"""The house rules a test can hold (docs/design.md: "Layers", "Import rules", habit 10, "File
map"): which layer imports which (the runtime and ``hf`` only the planner's formats; the
runtime's sub-packages downwards; benchmarks the library), no import circles, the size of
modules and functions as the formatter lays them out (no ``# fmt: skip``), unique module
basenames, and a file map that lists exactly the modules in the tree.

Imports are read with ``ast`` from every module, imports inside functions included, so a rule
holds whether or not a test happens to run the code that imports."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pipetrain"
DESIGN = ROOT / "docs" / "design.md"
BENCHMARKS = ROOT / "benchmarks"

LIBRARY = {"schedule", "sim", "render", "planner", "runtime", "hf"}
#: the parts of pipetrain each part may import (itself included): docs/design.md, "Layers".
#: ``pipetrain`` is the package root (``import pipetrain``, whose names load the runtime).
MAY_IMPORT: dict[str, set[str]] = {
    "schedule": {"schedule"},
    "sim": {"schedule", "sim"},
    "render": {"schedule", "sim", "render"},
    "planner": {"schedule", "sim", "planner"},
    "runtime": {"schedule", "sim", "planner", "runtime"},
    "hf": {"schedule", "planner", "runtime", "hf", "pipetrain"},
    "app": LIBRARY | {"app", "pipetrain"},
    "cli": LIBRARY | {"app", "cli", "pipetrain"},
    "__init__": LIBRARY - {"hf"},  # the package root: the library's API, loaded lazily
    "__main__": {"cli"},
}
#: the planner's formats: what a plan and a costs file say, apart from the search that makes them
#: (docs/design.md, "Import rules"). The runtime and ``hf`` read these and no other planner
#: module, and a format reads only other formats of the planner.
PLANNER_FORMATS = {"layout", "costs_file", "costs_file_tp", "recompute_modes"}
#: the parts held to the planner's formats
FORMAT_READERS = {"runtime", "hf"}
#: the runtime's sub-packages and what else of the runtime each may import (docs/design.md,
#: "Import rules"): a sub-package name, or a module at the runtime's top. ``comm`` is the floor,
#: ``profile`` the roof: it measures stages, and nothing that trains imports it.
RUNTIME_WINGS: dict[str, set[str]] = {
    "comm": {"torch_compat"},
    "backward": {"comm", "torch_compat", "named_layers"},
    "parallel": {"comm", "backward", "torch_compat"},
    "profile": {"comm", "backward", "torch_compat", "named_layers", "stage"},
}
#: modules at the runtime's top that the sub-packages stand on: they import only each other
RUNTIME_BASE = {"torch_compat", "named_layers", "side_inputs"}
#: the parts of the application a benchmark may import besides the library (docs/design.md,
#: "Import rules"): self-contained packages that import nothing else of the application — the
#: built-in GPT and its corpus, and the tokenized-data pipeline a data benchmark measures
BENCHMARK_APP = ("pipetrain.app.models", "pipetrain.app.data")
#: what each part may import from outside the standard library and pipetrain (the application
#: and the command line are not held to a list)
THIRD_PARTY: dict[str, set[str]] = {
    "schedule": set(),
    "sim": set(),
    "render": set(),
    "planner": set(),
    "runtime": {"torch"},
    "hf": {"torch", "transformers", "safetensors"},
    "__init__": set(),
    "__main__": set(),
}
#: what a part imports only inside functions (or for type checkers), so that ``import
#: pipetrain``, ``pipetrain --help`` and the planning commands never import torch
LAZY: dict[str, set[str]] = {
    "cli": {"runtime", "hf", "app", "torch", "transformers", "safetensors"},
    "__init__": LIBRARY | {"torch"},
}

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
#: modules over MAX_MODULE_LINES while work elsewhere shrinks them: path -> the most lines it
#: may have. An entry may only go down; delete it once the module is back within the limit.
OVER_MODULE_LINES: dict[str, int] = {}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def part_of(path: Path) -> str:
    """The part a module belongs to: its top package under pipetrain, or, for a module at the
    top, its own name."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else path.stem


def dotted(path: Path) -> list[str]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return parts[:-1] if parts[-1] == "__init__" else parts


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, type_checking: bool = True) -> Iterator[tuple[int, str, bool]]:
    """(line, imported dotted name, lazily?) for every import of a module, at any depth; lazy
    means inside a function or under ``if TYPE_CHECKING`` (left out with ``type_checking=False``:
    those never run). ``from a import b`` yields ``a.b`` (``b`` may be a module); relative
    imports are resolved."""
    package = dotted(path) if path.name == "__init__.py" else dotted(path)[:-1]
    stack: list[tuple[ast.AST, bool]] = [(ast.parse(path.read_text()), False)]
    while stack:
        node, lazy = stack.pop()
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name, lazy) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            yield from ((node.lineno, f"{module}.{alias.name}", lazy) for alias in node.names)
        inner = lazy or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack += [(child, True) for child in node.body if type_checking]
            stack += [(child, inner) for child in node.orelse]
            continue
        stack += [(child, inner) for child in ast.iter_child_nodes(node)]


def target_part(name: str) -> str:
    """The part of pipetrain an imported dotted name lies in, or its top-level package."""
    parts = name.split(".")
    if parts[0] != "pipetrain":
        return parts[0]
    if len(parts) > 1 and (PACKAGE / parts[1] / "__init__.py").exists():
        return parts[1]
    return "pipetrain"


def test_pure_layers_import_without_torch() -> None:
    blocker = """
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
    out = subprocess.run(
        [sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("clean")


def test_each_part_imports_only_the_parts_below_it() -> None:
    broken = []
    for path in modules():
        part = part_of(path)
        for line, name, _ in sorted(imports(path)):
            target = target_part(name)
            if name.split(".")[0] == "pipetrain" and target not in MAY_IMPORT[part]:
                legal = ", ".join(sorted(MAY_IMPORT[part]))
                broken.append(f"{rel(path)}:{line} imports {name}; {part} may import {legal}")
    assert broken == [], "layer rule broken (docs/design.md, Layers):\n" + "\n".join(broken)


def planner_module(name: str) -> str | None:
    """The planner module an imported dotted name lies in (``layout`` for
    ``pipetrain.planner.layout.Layout``), ``__init__`` for the package's own names, or None
    outside the planner."""
    parts = name.split(".")
    if parts[:2] != ["pipetrain", "planner"]:
        return None
    if len(parts) > 2 and (PACKAGE / "planner" / f"{parts[2]}.py").is_file():
        return parts[2]
    return "__init__"


def test_the_runtime_reads_only_the_planners_formats() -> None:
    broken = []
    for path in modules():
        part = part_of(path)
        is_format = part == "planner" and path.stem in PLANNER_FORMATS
        if part not in FORMAT_READERS and not is_format:
            continue
        for line, name, _ in sorted(imports(path)):
            module = planner_module(name)
            if module is not None and module not in PLANNER_FORMATS:
                legal = ", ".join(f"planner.{m}" for m in sorted(PLANNER_FORMATS))
                who = "a format" if is_format else part
                broken.append(f"{rel(path)}:{line} imports {name}; {who} may read {legal}")
    assert broken == [], "the planner's search imported where only its formats may be:\n" + (
        "\n".join(broken)
    )


def runtime_place(module: str) -> str | None:
    """Where a runtime module lies: its sub-package (``comm``), its own name for a module at the
    runtime's top (``stage``), ``__init__`` for the package itself; None outside the runtime."""
    parts = module.split(".")
    if parts[:2] != ["pipetrain", "runtime"]:
        return None
    return parts[2] if len(parts) > 2 else "__init__"


def runtime_import_problem(source: str, target: str) -> str | None:
    """Why the runtime module at ``source`` may not import the one at ``target`` (both
    ``runtime_place``s), or None where it may."""
    if source == target:
        return None
    if source in RUNTIME_WINGS and target not in RUNTIME_WINGS[source]:
        return f"runtime/{source}/ may import {', '.join(sorted(RUNTIME_WINGS[source]))}"
    if source in RUNTIME_BASE and target not in RUNTIME_BASE:
        return (
            f"{source} is under the sub-packages: it may import {', '.join(sorted(RUNTIME_BASE))}"
        )
    if source not in RUNTIME_WINGS and target == "profile":
        return "only the profiler's own modules import runtime/profile/ (nothing that trains)"
    return None


def test_the_runtimes_sub_packages_import_downwards() -> None:
    broken = []
    for path in modules():
        source = runtime_place(".".join(dotted(path)))
        if source is None:
            continue
        for line, name, _ in sorted(imports(path)):
            module = module_of(name)
            target = runtime_place(module) if module else None
            problem = None if target is None else runtime_import_problem(source, target)
            if problem:
                broken.append(f"{rel(path)}:{line} imports {name}; {problem}")
    assert broken == [], "runtime sub-package rule broken (docs/design.md, Import rules):\n" + (
        "\n".join(broken)
    )


def test_third_party_imports_stay_in_their_layers() -> None:
    broken = []
    for path in modules():
        part = part_of(path)
        if part not in THIRD_PARTY:
            continue
        for line, name, _ in sorted(imports(path)):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "pipetrain" or top == "__future__":
                continue
            if top not in THIRD_PARTY[part]:
                legal = ", ".join(sorted(THIRD_PARTY[part])) or "the standard library only"
                broken.append(f"{rel(path)}:{line} imports {name}; {part} may import {legal}")
    assert broken == [], "\n".join(broken)


def test_the_command_line_and_the_package_root_import_torch_code_lazily() -> None:
    broken = []
    for path in modules():
        part = part_of(path)
        for line, name, lazy in sorted(imports(path)):
            if part in LAZY and not lazy and target_part(name) in LAZY[part]:
                broken.append(f"{rel(path)}:{line} imports {name} at module level")
    assert broken == [], "import these inside the function that needs them:\n" + "\n".join(broken)


def test_modules_are_small() -> None:
    over = {}
    for path in modules():
        lines = len(path.read_text().splitlines())
        if lines > OVER_MODULE_LINES.get(rel(path), MAX_MODULE_LINES):
            over[rel(path)] = lines
    assert over == {}, f"modules over {MAX_MODULE_LINES} lines (docs/design.md, habit 10): {over}"
    back = [
        p
        for p in OVER_MODULE_LINES
        if not (ROOT / p).exists() or len((ROOT / p).read_text().splitlines()) <= MAX_MODULE_LINES
    ]
    assert back == [], (
        f"gone or within {MAX_MODULE_LINES} lines: drop from OVER_MODULE_LINES: {back}"
    )


def test_no_module_is_packed_to_meet_the_line_cap() -> None:
    """The formatter's layout is the one the line cap counts: a ``# fmt: skip`` (or ``fmt: off``)
    that packs lines to fit is refused; a module that needs it has two jobs (habit 10)."""
    packed = [
        f"{rel(path)}:{number}"
        for path in modules()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)\b", line)
    ]
    assert packed == [], "remove the formatter escape, reformat, split the module:\n" + "\n".join(
        packed
    )


def test_functions_are_small() -> None:
    """The library's functions and the benchmarks' alike (a benchmark is read as often as run)."""
    over = []
    for path in [*modules(), *sorted(BENCHMARKS.rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over.append(f"{rel(path)}:{node.lineno} {node.name}: {lines} lines")
    assert over == [], (
        f"functions over {MAX_FUNCTION_LINES} lines (docs/design.md, habit 10); split them:\n"
        + "\n".join(over)
    )


def test_no_two_modules_share_a_basename() -> None:
    names = Counter(p.name for p in modules() if p.name != "__init__.py")
    assert [name for name, count in names.items() if count > 1] == []


def file_map() -> list[str]:
    """The paths the "File map" section of docs/design.md lists, in order."""
    text = DESIGN.read_text()
    match = re.search(r"^## File map\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"{rel(DESIGN)} has no '## File map' section"
    return re.findall(r"^\s*- `(pipetrain/[^`]*)` — ", match.group(1), re.M)


def tree() -> list[str]:
    """What the file map must list: every package (as ``pipetrain/a/b/``) and every module but
    ``__init__.py``."""
    packages = [rel(p.parent) + "/" for p in PACKAGE.rglob("__init__.py")]
    return sorted(packages + [rel(p) for p in modules() if p.name != "__init__.py"])


def test_the_file_map_lists_every_package_and_module() -> None:
    listed, present = file_map(), tree()
    missing = [p for p in present if p not in listed]
    extra = [p for p in listed if p not in present]
    twice = sorted({p for p in listed if listed.count(p) > 1})
    problems = [f"add the line: - `{p}` — <what it owns>" for p in missing]
    problems += [f"remove the line of `{p}`: no such package or module" for p in extra]
    problems += [f"`{p}` is listed more than once" for p in twice]
    assert problems == [], f"{rel(DESIGN)}, section 'File map':\n" + "\n".join(problems)


def module_of(name: str) -> str | None:
    """The module of pipetrain an imported dotted name loads (``a.b.c`` where ``a/b/c.py`` or
    ``a/b/c/__init__.py`` exists, else its longest such prefix), or None outside pipetrain."""
    parts = name.split(".")
    if parts[0] != "pipetrain":
        return None
    while parts:
        path = ROOT.joinpath(*parts)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return ".".join(parts)
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of pipetrain it imports: at module level and inside functions alike
    (an import put off into a function still closes a circle, only later); imports under ``if
    TYPE_CHECKING`` are left out (they never run: annotations only)."""
    graph: dict[str, set[str]] = {}
    for path in modules():
        me = ".".join(dotted(path))
        targets = {module_of(name) for _, name, _ in imports(path, type_checking=False)}
        graph[me] = {t for t in targets if t is not None and t != me}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively), each
    sorted, each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def cycle_in(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """One circle through the component's first module, as the modules in import order (the
    first again at the end), to name in a failure."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"{component} is not strongly connected")


def test_circles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert cycle_in(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    problems = [" -> ".join(cycle_in(graph, c)) for c in circles(graph)]
    assert problems == [], (
        "import circles (lazy imports included; move what both sides need to where it belongs, "
        "docs/design.md, Import rules):\n" + "\n".join(problems)
    )


def test_benchmarks_use_the_library_not_the_application() -> None:
    broken = []
    for path in sorted(BENCHMARKS.rglob("*.py")):
        for line, name, _ in sorted(imports(path)):
            if name.split(".")[0] != "pipetrain" or target_part(name) in LIBRARY | {"pipetrain"}:
                continue
            if not any(name == a or name.startswith(a + ".") for a in BENCHMARK_APP):
                legal = ", ".join(BENCHMARK_APP)
                broken.append(f"{rel(path)}:{line} imports {name}; the library, {legal} only")
    assert broken == [], "benchmarks measure the library (docs/design.md, Import rules):\n" + (
        "\n".join(broken)
    )


def test_what_benchmarks_may_import_of_the_application_stands_alone() -> None:
    broken = []
    for path in modules():
        here = ".".join(dotted(path))
        if not any(here == a or here.startswith(a + ".") for a in BENCHMARK_APP):
            continue
        for line, name, _ in sorted(imports(path)):
            inside = any(name == a or name.startswith(a + ".") for a in BENCHMARK_APP)
            if target_part(name) in {"app", "cli"} and not inside:
                broken.append(f"{rel(path)}:{line} imports {name}")
    assert broken == [], "benchmarks import these packages; keep them apart:\n" + "\n".join(broken)
