"""Backend options: which keywords a Harbor environment class takes, checked before any sandbox starts.

Harbor's releases differ here. From 0.26 an environment may declare an
``options_model`` (a pydantic schema) and Harbor refuses any keyword it does
not list; 0.25 takes any ``**kwargs`` and silently drops what no constructor
names. So what a backend accepts is read off the installed Harbor, never off a
version number:

- a class with Harbor's ``options_model``: that schema, validated by Harbor's
  own ``parse_options`` (the check ``harbor run`` makes);
- otherwise, for Harbor's environments and this project's: the keywords their
  constructors name, along the ``__init__`` chain up to Harbor's
  ``BaseEnvironment`` (a keyword nobody names would be dropped unread);
- otherwise (a third-party class without a schema): unchecked, and said so.

The engine's own keyword, ``run_label``, goes only to backends that accept it.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from harbor_async.errors import BackendOptionsError

#: What the engine passes at every start itself: never a user's option.
RUNTIME_INPUTS = frozenset(
    {"self", "environment_dir", "environment_name", "session_id", "trial_paths", "task_env_config", "logger"}
)

#: Read by Harbor 0.25's ``BaseEnvironment`` out of ``**kwargs`` (a deprecated
#: switch with no named parameter); 0.26 lists it in its options schema.
_READ_FROM_KWARGS = frozenset({"suppress_override_warnings"})

#: The engine's keyword: names the run in sandbox folders and markers (reaper).
RUN_LABEL = "run_label"

#: Modules whose environment classes are checked by their signatures.
_KNOWN_MODULES = ("harbor.", "harbor_async.")


@dataclass(frozen=True)
class BackendOptions:
    """What one backend's environment class accepts as options (``--ek``, ``backend_kwargs``).

    Attributes:
        backend: the backend's name, for messages.
        source: ``"schema"`` (Harbor's ``options_model``), ``"signature"``
            (the constructors' named keywords) or ``"unchecked"``.
        names: the accepted option names (empty when unchecked).
        own: the backend's own names among them (the rest are Harbor's
            ``BaseEnvironment`` keywords every environment takes), listed first.
    """

    backend: str
    source: Literal["schema", "signature", "unchecked"]
    names: frozenset[str]
    own: frozenset[str] = frozenset()
    _cls: type | None = None

    def listing(self) -> list[str]:
        """The names for a message: the backend's own, then Harbor's common ones."""
        return sorted(self.own) + sorted(self.names - self.own)

    @property
    def checked(self) -> bool:
        """Whether unknown options can be told apart (False: a third-party class without a schema)."""
        return self.source != "unchecked"

    def accepts(self, name: str) -> bool:
        """Whether ``name`` can be passed without the class refusing or dropping it."""
        return name in self.names

    def check(self, options: Mapping[str, Any]) -> None:
        """Refuse options the backend does not take, with the valid names and a "did you mean".

        Raises:
            BackendOptionsError: an unknown name, or (with a Harbor schema) a
                value Harbor's own validation refuses.
        """
        if not self.checked:
            return
        unknown = sorted(name for name in options if name not in self.names)
        if unknown:
            raise BackendOptionsError(self.backend, unknown, self.listing(), _suggestions(unknown, self.names))
        if self.source == "schema" and self._cls is not None:
            try:
                self._cls.parse_options(dict(options))
            except ValueError as exc:  # Harbor's message names each refused option
                detail = " ".join(line.strip() for line in str(exc).splitlines()[1:-1]) or str(exc)
                raise BackendOptionsError(self.backend, [], self.listing(), {}, detail=detail) from None

    def engine_options(self, run_label: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """The keywords a start passes: the user's options, and the run label where it is accepted."""
        if self.accepts(RUN_LABEL):
            return {RUN_LABEL: run_label, **options}
        return dict(options)


def _suggestions(unknown: list[str], names: frozenset[str]) -> dict[str, str]:
    found = {}
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.6)
        if close:
            found[name] = close[0]
    return found


def _signature_names(cls: type) -> tuple[frozenset[str], frozenset[str]]:
    """(all, own): the keywords named along ``cls``'s ``__init__`` chain, to Harbor's ``BaseEnvironment``.

    ``own`` leaves out ``BaseEnvironment``'s, which every environment takes.
    """
    from harbor.environments.base import BaseEnvironment

    names: set[str] = set()
    own: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameters = inspect.signature(init).parameters.values()
        named = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        names |= named
        if klass is not BaseEnvironment:
            own |= named
        if klass is BaseEnvironment or not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    if issubclass(cls, BaseEnvironment):
        names |= _READ_FROM_KWARGS
    return frozenset(names - RUNTIME_INPUTS), frozenset(own - RUNTIME_INPUTS)


def _schema_names(schema: type) -> frozenset[str]:
    names = set()
    for name, info in schema.model_fields.items():
        names.add(name)
        if isinstance(info.alias, str):
            names.add(info.alias)
    return frozenset(names)


@cache
def options_of(backend: str, cls: type) -> BackendOptions:
    """What ``cls`` (the environment class of ``backend``) accepts, read off the installed Harbor."""
    schema = getattr(cls, "options_model", None)
    if isinstance(schema, type) and hasattr(schema, "model_fields") and hasattr(cls, "parse_options"):
        names = _schema_names(schema)
        return BackendOptions(backend, "schema", names, names, cls)
    if cls.__module__.startswith(_KNOWN_MODULES):
        return BackendOptions(backend, "signature", *_signature_names(cls), cls)
    return BackendOptions(backend, "unchecked", frozenset(), frozenset(), cls)
