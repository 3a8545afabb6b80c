"""The layers of ``harbor_async`` (``docs/architecture.md``, "Layers"): no import reaches a later layer.

The table in the docs is the one statement of the layers; this test reads it.
Every import counts, as in :mod:`tests.test_import_graph`: at module level,
under ``TYPE_CHECKING`` and inside functions.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_import_graph import EDGES

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"


def _layers() -> list[tuple[str, list[str]]]:
    """(layer, its entries) from the docs' table, lowest first; an entry is a top-level module or subpackage."""
    block = DOC.read_text(encoding="utf-8").split("<!-- layers: begin")[1].split("<!-- layers: end")[0]
    layers = []
    for line in block.splitlines():
        if line.startswith("| `"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            layers.append((cells[0].strip("`"), re.findall(r"`([^`]+)`", cells[2])))
    return layers


LAYERS = _layers()
RANK = {entry: rank for rank, (_layer, entries) in enumerate(LAYERS) for entry in entries}


def _entry(module: str) -> str:
    """``harbor_async.backends.local.adapter`` -> ``backends``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(edges: dict[str, dict[str, bool]]) -> list[str]:
    """Each import of ``edges`` from a module to one of a later layer, as ``a -> b (layer x -> layer y)``."""
    found = []
    for importer, targets in sorted(edges.items()):
        if not importer.startswith("harbor_async"):
            continue
        for target in sorted(targets):
            if target.startswith("harbor_async") and RANK[_entry(target)] > RANK[_entry(importer)]:
                low, high = LAYERS[RANK[_entry(importer)]][0], LAYERS[RANK[_entry(target)]][0]
                found.append(f"{importer} -> {target} ({low} -> {high})")
    return found


def test_every_module_has_exactly_one_layer():
    entries = [entry for _layer, layer_entries in LAYERS for entry in layer_entries]
    assert len(LAYERS) >= 10 and len(entries) == len(set(entries)), entries
    modules = {_entry(name) for name in EDGES if name.startswith("harbor_async")}
    assert modules == set(entries), (sorted(modules - set(entries)), sorted(set(entries) - modules))


def test_no_import_reaches_a_later_layer():
    assert upward_imports(EDGES) == []


def imported_layers(entry: str, edges: dict[str, dict[str, bool]]) -> set[str]:
    """The other layers that the modules of ``entry`` (a package) import."""
    found = set()
    for importer, targets in edges.items():
        if importer.startswith("harbor_async") and _entry(importer) == entry:
            for target in targets:
                if target.startswith("harbor_async") and RANK[_entry(target)] != RANK[entry]:
                    found.add(LAYERS[RANK[_entry(target)]][0])
    return found


def stated_layers(package: Path) -> set[str] | None:
    """The layers a package's docstring says it imports (its ``Imports:`` line), or ``None`` without one."""
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    line = next((line for line in docstring.splitlines() if line.startswith("Imports: ")), None)
    if line is None:
        return None
    names = line.removeprefix("Imports: ").rstrip(".")
    return set() if names == "nothing of harbor_async" else {name.strip() for name in names.split(",")}


def test_each_package_says_what_it_imports():
    """Each subpackage's docstring names the layers it imports, no more and no fewer."""
    packages = [entry for entry in RANK if (REPO / "harbor_async" / entry / "__init__.py").exists()]
    assert len(packages) >= 12, packages
    found = {entry: (stated_layers(REPO / "harbor_async" / entry), imported_layers(entry, EDGES)) for entry in packages}
    wrong = {entry: (stated, sorted(imported)) for entry, (stated, imported) in found.items() if stated != imported}
    assert wrong == {}, "package: (its docstring's Imports line, what it imports)"


def test_the_top_level_is_short():
    """About a dozen layers, each one package (or module), and nothing else at the top of ``harbor_async``."""
    top = sorted(path.name for path in (REPO / "harbor_async").iterdir() if path.name != "__pycache__")
    assert len(top) <= 18, top
    names = {name.removesuffix(".py") for name in top} - {"py.typed"}
    assert names == set(RANK), (sorted(names - set(RANK)), sorted(set(RANK) - names))


def test_an_import_to_a_later_layer_is_found():
    """The check above can fail: an import of the engine from the errors module, or a lazy one of the CLI, is caught."""
    edges = {
        "harbor_async.core.errors": {"harbor_async.engine.engine": False},
        "harbor_async.episodes.judging": {"harbor_async.cli.run": True, "harbor_async.core.policy": False},
    }
    assert upward_imports(edges) == [
        "harbor_async.core.errors -> harbor_async.engine.engine (core -> engine)",
        "harbor_async.episodes.judging -> harbor_async.cli.run (episodes -> cli)",
    ]
