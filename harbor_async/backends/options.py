"""Backend options: which keywords a Harbor environment class takes, checked before any sandbox starts.

Harbor's releases differ here. From 0.26 an environment may declare an
``options_model`` (a pydantic schema) and Harbor refuses any keyword it does
not list; 0.25 takes any ``**kwargs`` and silently drops what no constructor
names. So what a backend accepts is read off the installed Harbor, never off a
version number:

- a class with Harbor's ``options_model``: that schema's own validation (what
  Harbor's ``parse_options``, the check ``harbor run`` makes, runs), plus the
  keywords this project's subclass of it names itself (the confined docker
  class's ``transfer_limit_mb``, ``output_limit``, ``fast_start``): its
  constructor takes them before Harbor's sees the rest, so the schema is shown
  only the rest;
- otherwise, for Harbor's environments and this project's: the keywords their
  constructors name, along the ``__init__`` chain up to Harbor's
  ``BaseEnvironment`` (a keyword nobody names would be dropped unread), unless
  a class of the chain reads keywords out of ``**kwargs`` itself (Harbor 0.25's
  modal, daytona, ...: ``kwargs.get("modal_vm_runtime")``): those are unchecked,
  since no signature lists what they read;
- otherwise (a third-party class without a schema): unchecked, and said so.

Harbor's schemas may take old names and map them before validation (0.26's
e2b takes 0.25's ``sandbox_timeout_secs``), so with a schema the names are
whatever its validation accepts, not only its fields.

The engine's own keyword, ``run_label``, goes only to backends that accept it.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from harbor_async.core.errors import BackendOptionsError

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
        names: the accepted option names (when unchecked: the names the
            constructors list, which may not be all).
        own: the backend's own names among them (the rest are Harbor's
            ``BaseEnvironment`` keywords every environment takes), listed first.
    """

    backend: str
    source: Literal["schema", "signature", "unchecked"]
    names: frozenset[str]
    own: frozenset[str] = frozenset()
    _cls: type | None = None
    #: With a schema: the names this project's subclass takes itself (kept from the schema's validation).
    subclass_names: frozenset[str] = frozenset()

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
        if self.source == "schema":
            self._check_with_schema(options)
        elif self.checked:
            unknown = sorted(name for name in options if name not in self.names)
            if unknown:
                raise BackendOptionsError(self.backend, unknown, self.listing(), _suggestions(unknown, self.names))

    def _check_with_schema(self, options: Mapping[str, Any]) -> None:
        """Harbor's own validation (``options_model``), its refusals turned into one typed error."""
        from pydantic import ValidationError

        schema: Any = getattr(self._cls, "options_model", None)  # a pydantic model: source is "schema"
        try:
            schema.model_validate({k: v for k, v in options.items() if k not in self.subclass_names})
        except ValidationError as exc:
            errors = exc.errors(include_url=False, include_input=False)
            unknown = sorted({".".join(map(str, e["loc"])) for e in errors if e["type"] == "extra_forbidden"})
            other = [f"{'.'.join(map(str, e['loc'])) or 'options'}: {e['msg']}" for e in errors if e["type"] != "extra_forbidden"]
            raise BackendOptionsError(
                self.backend, unknown, self.listing(), _suggestions(unknown, self.names), detail="; ".join(other)
            ) from None

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
        named = _keywords(parameters)
        names |= named
        if klass is not BaseEnvironment:
            own |= named
        if klass is BaseEnvironment or not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    if issubclass(cls, BaseEnvironment):
        names |= _READ_FROM_KWARGS
    return frozenset(names - RUNTIME_INPUTS), frozenset(own - RUNTIME_INPUTS)


def _subclass_names(cls: type) -> frozenset[str]:
    """The keywords this project's classes of ``cls``'s chain name, above the first class that is not ours."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("harbor_async."):
            break
        init = klass.__dict__.get("__init__")
        if init is not None:
            names |= _keywords(inspect.signature(init).parameters.values())
    return frozenset(names - RUNTIME_INPUTS)


def _keywords(parameters: Any) -> set[str]:
    """The names an ``__init__`` takes as keywords."""
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def _schema_names(schema: type[Any]) -> frozenset[str]:
    names = set()
    for name, info in schema.model_fields.items():
        names.add(name)
        if isinstance(info.alias, str):
            names.add(info.alias)
    return frozenset(names)


#: A class body that takes options out of ``**kwargs`` by name, past its signature.
_READS_KWARGS = re.compile(r"\bkwargs\s*(?:\.get\(|\.pop\(|\[)|\bself\._kwargs\b")


def _reads_kwargs(cls: type) -> bool:
    """Whether a class of ``cls``'s chain below Harbor's ``BaseEnvironment`` reads keywords out of ``**kwargs``."""
    from harbor.environments.base import BaseEnvironment

    for klass in cls.__mro__:
        if klass is BaseEnvironment or not issubclass(klass, BaseEnvironment):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):  # no source to read: cannot tell, so do not refuse
            return True
        if _READS_KWARGS.search(source):
            return True
    return False


@cache
def options_of(backend: str, cls: type) -> BackendOptions:
    """What ``cls`` (the environment class of ``backend``) accepts, read off the installed Harbor."""
    schema = getattr(cls, "options_model", None)
    if isinstance(schema, type) and hasattr(schema, "model_validate"):
        ours = _subclass_names(cls)
        names = _schema_names(schema) | ours
        return BackendOptions(backend, "schema", names, names, cls, subclass_names=ours)
    names, own = _signature_names(cls)
    if cls.__module__.startswith(_KNOWN_MODULES) and not _reads_kwargs(cls):
        return BackendOptions(backend, "signature", names, own, cls)
    # Unchecked: nothing is refused, but the engine's run label still goes where a constructor names it.
    return BackendOptions(backend, "unchecked", names, own, cls)
