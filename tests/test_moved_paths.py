"""The flat layout's import paths still work for one release, each with a DeprecationWarning naming the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from harbor_async.core.moved import FORWARDED, MOVED, RENAMED


def _import_fresh(name: str) -> tuple[object, list[warnings.WarningMessage]]:
    sys.modules.pop(name, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, caught


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_the_new_module(old: str) -> None:
    module, caught = _import_fresh(old)
    assert module is importlib.import_module(MOVED[old])  # one object: patching either name patches both
    assert module.__name__ == MOVED[old]
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        f"{old} moved to {MOVED[old]}; the old path goes in the next release"
    ]


def test_old_paths_cover_every_module_that_moved() -> None:
    """Every module of the flat layout (its name at the top of the package) has an old path that still imports."""
    flat = {old.removeprefix("harbor_async.") for old in [*MOVED, *FORWARDED]}
    assert len(flat) == 55 and "evaluation" not in flat  # the 56 modules of the flat layout; evaluation.py stayed
    assert all(old.count(".") == 1 for old in [*MOVED, *FORWARDED])
    for package, home in FORWARDED.items():  # a package that took the old module's name, and that module's new home
        assert importlib.import_module(package).__path__ and importlib.import_module(home).__name__ == home


@pytest.mark.parametrize(
    ("package", "name", "home"),
    [
        ("harbor_async.engine", "Engine", "harbor_async.engine.engine"),
        ("harbor_async.tasks", "load_suite", "harbor_async.tasks.suite"),
        ("harbor_async.jobs", "JobFolder", "harbor_async.jobs.folder"),
    ],
)
def test_a_package_that_took_an_old_modules_name_forwards_its_names(package: str, name: str, home: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = getattr(importlib.import_module(package), name)
    assert found is getattr(importlib.import_module(home), name)
    assert any(f"{package}.{name} moved to {home}.{name}" in str(w.message) for w in caught)
    assert caught[0].filename == __file__  # the warning points at the caller, not at our code
    with pytest.raises(AttributeError):
        importlib.import_module(package).no_such_name  # noqa: B018


def test_a_submodule_is_imported_not_forwarded() -> None:
    """``from harbor_async.engine import loop`` is the package's own module, with no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from harbor_async.engine import loop

    assert loop.__name__ == "harbor_async.engine.loop"


def test_the_public_api_and_new_paths_import_without_a_warning() -> None:
    """Nothing of ours imports an old path: a fresh interpreter that turns the warning into an error imports all."""
    script = (
        "import warnings\n"
        "warnings.filterwarnings('error', message=r'harbor_async\\..* moved to ', category=DeprecationWarning)\n"
        "import harbor_async, pkgutil, importlib, shim\n"
        "for info in pkgutil.walk_packages(harbor_async.__path__, 'harbor_async.'):\n"
        "    if not info.name.endswith('__main__'):\n"
        "        importlib.import_module(info.name)\n"
        "print(len(harbor_async.__all__))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout) > 20


def test_the_docs_table_lists_every_old_path() -> None:
    """docs/architecture.md's table of old and new paths is the finder's own (nothing left out, nothing stale)."""
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = page.split("<!-- moved: begin")[1].split("<!-- moved: end")[0]
    table = dict(re.findall(r"^\| `([\w.]+)` \| `([\w.]+)` \|$", block, re.M))
    assert table == {**MOVED, **FORWARDED}


@pytest.mark.parametrize(("module", "old", "new"), [(m, o, n) for m, names in sorted(RENAMED.items()) for o, n in names.items()])
def test_a_renamed_class_answers_to_its_old_name(module: str, old: str, new: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = getattr(importlib.import_module(module), old)
    assert found is getattr(importlib.import_module(module), new) and found.__name__ == new
    assert [str(w.message) for w in caught] == [f"{module}.{old} moved to {module}.{new}; the old path goes in the next release"]
    with pytest.raises(AttributeError):
        getattr(importlib.import_module(module), "NoSuchClass")


def test_the_record_s_infrastructure_failure_is_deprecated_for_judged() -> None:
    """It was ``not judged`` under a name that said less than it covers: it warns, and still answers as before."""
    from harbor_async.core.errors import FailureClass
    from harbor_async.core.records import EpisodeRecord

    cancelled = EpisodeRecord(task="t", task_path="t", attempt=0)
    cancelled.set_error(FailureClass.CANCELLED, "stopped")
    judged = EpisodeRecord(task="t", task_path="t", attempt=0, reward=0.0)
    for record in (cancelled, judged):
        with pytest.warns(DeprecationWarning, match="read `judged` and `unjudged_as`"):
            assert record.infrastructure_failure is (not record.judged)
    assert (cancelled.judged, judged.judged, cancelled.unjudged_as) == (False, True, "cancelled")
    assert "infrastructure_failure" not in judged.to_dict()  # never stored: nothing to read back from old job folders
