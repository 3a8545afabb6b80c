"""The layers of ``harbor_async`` (``docs/architecture.md``, "Layers"): no import reaches a later layer.

The table in the docs is the one statement of the layers; this test reads it.
Every import counts, as in :mod:`tests.test_import_graph`: at module level,
under ``TYPE_CHECKING`` and inside functions.
"""

from __future__ import annotations

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


def test_an_import_to_a_later_layer_is_found():
    """The check above can fail: an import of the engine from the errors module, or a lazy one of the CLI, is caught."""
    edges = {
        "harbor_async.errors": {"harbor_async.engine": False},
        "harbor_async.judging": {"harbor_async.cli.run": True, "harbor_async.policy": False},
    }
    assert upward_imports(edges) == [
        "harbor_async.errors -> harbor_async.engine (core -> engine)",
        "harbor_async.judging -> harbor_async.cli.run (episodes -> cli)",
    ]
