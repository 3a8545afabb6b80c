"""The shape of the code: no import cycles, and a core that never imports the shim or the benchmarks.

Every import counts: module-level ones, those under ``if TYPE_CHECKING:`` and
those inside functions (a lazy import is still a dependency). The one exception
to the core rule: the command line (``harbor_async.cli.*``) may import the shim
or the benchmarks inside a function (``bench`` runs the benchmarks).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("harbor_async", "shim")
PROJECT = (*PACKAGES, "benchmarks")


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _imports(name: str, path: Path) -> dict[str, bool]:
    """Every project module ``name`` imports, mapped to whether it is only imported inside functions."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: dict[str, bool] = {}

    def add(target: str, in_function: bool) -> None:
        found[target] = found.get(target, True) and in_function

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, in_function)
            elif isinstance(child, ast.ImportFrom):
                module = _resolve(name, path.name == "__init__.py", child)
                for alias in child.names:
                    sub = f"{module}.{alias.name}"
                    add(sub if sub in MODULES else module, in_function)
            visit(child, inner)

    visit(tree, False)
    return {m: lazy for m, lazy in found.items() if m.split(".")[0] in PROJECT and m != name}


EDGES = {name: _imports(name, path) for name, path in MODULES.items()}
GRAPH = {name: set(targets) for name, targets in EDGES.items()}


def test_the_walker_sees_known_edges():
    assert "harbor_async.engine.sandbox" in GRAPH["harbor_async.engine.engine"]
    assert "harbor_async.core.errors" in GRAPH["harbor_async.engine.sandbox"]
    assert "harbor_async.engine.engine" in GRAPH["shim.engines"]
    assert "harbor_async.engine.engine" in GRAPH["harbor_async.episodes.episode"]  # under TYPE_CHECKING
    assert EDGES["harbor_async.episodes.judging"]["harbor_async.verification.artifacts"] is True  # inside a function


def test_no_import_cycles():
    # Tarjan's strongly connected components over the project's modules.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH.get(node, ()):
            if target not in GRAPH:
                continue
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in GRAPH:
        if node not in index:
            connect(node)
    assert cycles == []


def test_the_core_imports_neither_the_shim_nor_the_benchmarks():
    bad = {
        name: sorted(
            target
            for target, lazy in targets.items()
            if target.split(".")[0] in ("shim", "benchmarks") and not (name.startswith("harbor_async.cli") and lazy)
        )
        for name, targets in EDGES.items()
        if name.startswith("harbor_async")
    }
    assert {name: targets for name, targets in bad.items() if targets} == {}


def test_the_sandbox_never_imports_the_engine():
    assert "harbor_async.engine.engine" not in GRAPH["harbor_async.engine.sandbox"]


def test_the_benchmarks_never_import_the_tests():
    found = {}
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        bad = [n for n in names if n.split(".")[0] == "tests"]
        if bad:
            found[path.name] = bad
    assert found == {}


@pytest.mark.slow  # one fresh import per module with a lazy import of ours (about 20 s here)
def test_a_lazy_import_of_ours_saves_an_import():
    """An import of our own inside a function is there to keep something out of its module's import (a heavy
    or optional part, the CLI's start), never to dodge a cycle (the layers forbid those): its target is not
    already loaded by importing the module itself."""
    lazy = {(a, b) for a, targets in EDGES.items() for b, only in targets.items() if only and a.startswith("harbor_async") and b.startswith("harbor_async")}
    importers = sorted({a for a, _ in lazy})
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "loaded_modules.py"), *importers], capture_output=True, text=True, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout)
    assert len(lazy) >= 40 and len(loaded) == len(importers)
    assert sorted((a, b) for a, b in lazy if b in loaded[a]) == []
