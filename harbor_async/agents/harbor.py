"""Harbor's own agents (``terminus-2``, ``claude-code``, ``module:Class``) as episode agents, for ``run`` and ``eval``.

``-a NAME`` takes any agent Harbor's ``AgentFactory`` knows, or an import path
to a Harbor ``BaseAgent`` subclass; ``-m MODEL`` and ``--ak key=value`` are read
as ``harbor run`` reads them (Harbor's own parser). A :class:`HarborAgentSpec`
names the agent and builds it with Harbor's factory; what cannot run where
is refused before any sandbox starts (:func:`backend_refusal`, one line;
:func:`task_refusals`, per task, through :mod:`harbor_async.agents.task_checks`).
One episode of it is a :class:`~harbor_async.agents.harbor_episode.HarborAgentRunner`.

Two defaults differ from ``harbor run`` because sandboxes here are offline:
``record_terminal_session`` is off (asciinema would have to be installed from
the network), and a ``hosted_vllm/`` model gets a ``model_info`` (token limits,
zero cost) when none is given, since LiteLLM refuses such a model without one.
``--ak`` overrides both.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harbor_async.core.errors import AgentConfigError

if TYPE_CHECKING:
    from harbor.agents.base import BaseAgent
    from harbor.models.task.task import Task

#: ``model_info`` given to a ``hosted_vllm/`` model that has none (LiteLLM refuses the model without one).
DEFAULT_MODEL_INFO = {
    "max_input_tokens": 32768,
    "max_output_tokens": 8192,
    "input_cost_per_token": 0.0,
    "output_cost_per_token": 0.0,
    "cache_creation_input_token_cost": 0.0,  # else LiteLLM warns at every build that it assumes 0
    "cache_read_input_token_cost": 0.0,
}
#: Host programs an agent needs in ``local`` sandboxes (which run the host's ``/usr``), by agent class name.
HOST_TOOLS = {"Terminus2": ("tmux",)}
#: Providers (Harbor's parse of ``-m``) whose server speaks OpenAI's API when no API format is chosen.
_OPENAI_PROVIDERS = frozenset({None, "openai", "hosted_vllm"})
#: Names LiteLLM's ``hosted_vllm/`` provider takes (one path segment); others go through ``openai/``.
_HOSTED_VLLM_NAME = re.compile(r"[A-Za-z0-9._-]{1,63}")


def agent_names() -> list[str]:
    """The agent names ``-a`` takes: Harbor's registered ones, and ``none`` (``nop``)."""
    from harbor.agents.factory import AgentFactory

    return sorted({*AgentFactory.registered_names(), "none"})


def agent_class(name: str) -> type[BaseAgent]:
    """The Harbor agent class of ``name`` (an agent name or ``module:Class``).

    Raises:
        AgentConfigError: an unknown name (one line listing the choices), or a class that does not load.
    """
    # LiteLLM (terminus-2's client) fetches its model price map at import: offline that is three
    # timed-out attempts and warnings on every run. Its bundled copy is as good for our use.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    from harbor.agents.base import BaseAgent
    from harbor.agents.factory import AgentFactory
    from harbor.models.trial.config import AgentConfig

    if ":" not in name and name not in agent_names():
        raise AgentConfigError(f"unknown agent {name!r}; choose one of: {', '.join(agent_names())}, or module:Class")
    try:
        cls = AgentFactory.get_agent_class_from_config(AgentConfig(name="nop" if name == "none" else name))
    except Exception as exc:  # ImportError, AttributeError, a vendor SDK missing ...
        raise AgentConfigError(f"agent {name!r} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, BaseAgent)):
        raise AgentConfigError(f"agent {name!r} is not a Harbor BaseAgent subclass: {cls!r}")
    return cls


def is_harbor_agent(name: str) -> bool:
    """Whether ``eval``'s ``-a NAME`` names a Harbor agent rather than a tool harness.

    Harbor's agent names, and an import path to a Harbor ``BaseAgent`` subclass;
    anything else (``bash``, ``python``, ``terminal``, a harness class or file) is a harness.
    """
    if name in ("bash", "python", "terminal"):  # the bundled harnesses (harbor_async.harnesses)
        return False
    if ":" not in name:
        return name in agent_names()
    try:
        agent_class(name)
    except AgentConfigError:
        return False
    return True


def installs_itself(cls: type) -> bool:
    """Whether the agent installs itself into the sandbox at setup (Harbor's ``BaseInstalledAgent``): it needs the network."""
    from harbor.agents.installed.base import BaseInstalledAgent

    return issubclass(cls, BaseInstalledAgent)


def parse_agent_kwargs(pairs: Sequence[str] | None) -> dict[str, Any]:
    """``--ak key=value`` pairs, parsed by Harbor's own CLI parser (JSON, Python literals, else text)."""
    from harbor.cli.utils import parse_kwargs

    try:
        return parse_kwargs(list(pairs or ()))
    except ValueError as exc:
        raise AgentConfigError(f"--ak: {exc}") from None


def served_model_name(name: str) -> str:
    """The LiteLLM model name of a model served at an OpenAI-compatible URL (eval's ``-m``).

    ``hosted_vllm/NAME`` when LiteLLM's vLLM provider takes the name (one path
    segment); else ``openai/NAME`` (a checkpoint path), the same API.
    """
    return f"hosted_vllm/{name}" if _HOSTED_VLLM_NAME.fullmatch(name) else f"openai/{name}"


def _accepts(cls: type, name: str) -> bool:
    """Whether ``cls(...)`` takes the keyword ``name`` by its own signature (not only through ``**kwargs``)."""
    try:
        return name in inspect.signature(cls.__init__).parameters  # type: ignore[misc]  # the class's own __init__, as meant
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class HarborAgentSpec:
    """One Harbor agent as ``-a NAME -m MODEL --ak key=value`` give it.

    Attributes:
        name: a Harbor agent name or ``module:Class``.
        model_name: Harbor's ``model_name`` (LiteLLM's ``provider/model``), if the agent takes one.
        kwargs: the agent's constructor options (``--ak``).
    """

    name: str
    model_name: str | None = None
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def agent_class(self) -> type[BaseAgent]:
        """The agent's class (raises :class:`AgentConfigError`)."""
        return agent_class(self.name)

    def options(self) -> dict[str, Any]:
        """The constructor options: ``kwargs`` over this project's offline defaults (see the module docstring)."""
        cls, options = self.agent_class, dict(self.kwargs)
        if _accepts(cls, "record_terminal_session"):
            options.setdefault("record_terminal_session", False)
        if (self.model_name or "").startswith("hosted_vllm/") and _accepts(cls, "model_info"):
            options.setdefault("model_info", dict(DEFAULT_MODEL_INFO))
        return options

    def build(self, logs_dir: Path, task: Task | None = None) -> BaseAgent:
        """A new agent from Harbor's ``AgentFactory``, logging into ``logs_dir``.

        With the ``task``, its ``mcp_servers`` and ``skills_dir`` are the agent's, as Harbor's trial gives them.
        """
        from harbor.agents.factory import AgentFactory
        from harbor.models.agent.name import AgentName

        options, name = self.options(), "nop" if self.name == "none" else self.name
        environment = task.config.environment if task is not None else None
        if environment is not None and environment.mcp_servers:
            options.setdefault("mcp_servers", list(environment.mcp_servers))
        if environment is not None and environment.skills_dir:
            options.setdefault("skills_dir", environment.skills_dir)
        if ":" in name:
            return AgentFactory.create_agent_from_import_path(name, logs_dir=logs_dir, model_name=self.model_name, **options)
        return AgentFactory.create_agent_from_name(AgentName(name), logs_dir=logs_dir, model_name=self.model_name, **options)

    def check(self) -> None:
        """Build the agent once in a scratch folder (nothing started) so bad options fail before any sandbox.

        Raises:
            AgentConfigError: the agent refuses its options.
        """
        import tempfile

        try:
            with tempfile.TemporaryDirectory(prefix="harbor-async-agent-check-") as scratch:
                self.build(Path(scratch))
        except AgentConfigError:
            raise
        except Exception as exc:  # the agent's own validation: a missing model, an unknown option ...
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise AgentConfigError(f"agent {self.name!r} refuses its options: {text}") from exc

    def model_endpoint(self) -> tuple[str, str | None] | None:
        """(base URL, API key) of the OpenAI-compatible model server this agent calls, as Harbor resolves them.

        Harbor's own connection resolution (the one its agent runs with) gives the
        URL the user supplied (``--ak api_base``, ``--base-url``, an
        ``OPENAI_BASE_URL``-style variable; never a provider's inferred default)
        and the key (``--api-key-name``'s variable, ``llm_kwargs.api_key``, the
        provider's variable). An agent Harbor resolves no connection for falls back
        to its ``api_base``/``base_url`` option. ``None``: no URL of its own, or a
        server of another API (Anthropic's messages, Gemini, Bedrock: no
        ``/models`` of OpenAI's to ask). Raises :class:`AgentConfigError`.
        """
        import tempfile

        try:
            with tempfile.TemporaryDirectory(prefix="harbor-async-agent-check-") as scratch:
                connection = getattr(self.build(Path(scratch)), "model_connection", None)
        except AgentConfigError:
            raise
        except Exception as exc:  # the agent's own validation of its connection options
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise AgentConfigError(f"agent {self.name!r} refuses its model connection: {text}") from exc
        url = getattr(connection, "user_supplied_base_url", None)
        key = getattr(connection, "api_key", None)
        api = str(getattr(connection, "model_api_format", None) or "")
        provider = getattr(connection, "provider", None)
        if url and not (api.startswith("openai_") or (not api and provider in _OPENAI_PROVIDERS)):
            return None  # another API than OpenAI's
        if not url:
            options = self.options()
            url = options.get("api_base") or options.get("base_url")
            key = key or (options.get("llm_kwargs") or {}).get("api_key")
        return (str(url), key) if url else None

    def through_proxy(self, base_url: str, api_key: str) -> HarborAgentSpec:
        """This agent calling the same model through the capture proxy at ``base_url``, with its session's ``api_key``.

        The URL goes where :meth:`with_server` puts it and the key into LiteLLM's ``llm_kwargs``, over any
        the options named (the proxy forwards under the model server's own key). An agent that can record its
        own token ids (terminus-2's ``collect_rollout_details``) is asked to, unless the options say otherwise:
        the capture is checked against them.
        """
        cls = self.agent_class
        options = {key: value for key, value in self.kwargs.items() if key not in ("api_base", "base_url", "model_api_key_name")}
        options.update(endpoint_options(cls, base_url))
        options["llm_kwargs"] = {**(self.kwargs.get("llm_kwargs") or {}), "api_key": api_key}
        if _accepts(cls, "collect_rollout_details"):  # Harbor's own record of the ids, checked against the capture
            options.setdefault("collect_rollout_details", True)
        return HarborAgentSpec(self.name, self.model_name, options)

    def check_capture(self) -> tuple[str, str | None]:
        """The model server a captured run of this agent forwards to: (base URL, key); refused up front otherwise.

        Raises:
            AgentConfigError: the agent runs inside the sandbox (an installed agent: the sandbox cannot reach the
                host's loopback proxy), takes no LiteLLM ``llm_kwargs`` (no way to hand it its session's key),
                or calls no OpenAI-compatible server of its own (a hosted provider, another API).
        """
        from harbor.agents.installed.base import BaseInstalledAgent

        cls = self.agent_class
        if issubclass(cls, BaseInstalledAgent):
            raise AgentConfigError(
                f"--capture: agent {self.name!r} runs inside the sandbox, which cannot reach the capture proxy on the host's loopback"
            )
        if not _accepts(cls, "llm_kwargs"):
            raise AgentConfigError(f"--capture: agent {self.name!r} takes no llm_kwargs, so it cannot be given its session's key")
        endpoint = self.model_endpoint()
        if endpoint is None:
            raise AgentConfigError(
                f"--capture: agent {self.name!r} calls no OpenAI-compatible server of its own: give --ak api_base=URL (or -m with --base-url in eval)"
            )
        return endpoint

    def with_server(self, served_name: str, base_url: str, *, api_key_name: str | None = None,
                    temperature: float | None = None) -> HarborAgentSpec:  # fmt: skip
        """This agent pointed at ``served_name`` on the OpenAI-compatible server ``base_url`` (``eval``).

        terminus-2 and agents like it take the URL as ``api_base``; others as Harbor's ``base_url``.
        ``--ak`` values win over these.
        """
        cls, model = self.agent_class, served_model_name(served_name)
        options = endpoint_options(cls, base_url, api_key_name)
        if api_key_name is None and model.startswith("openai/") and _accepts(cls, "llm_kwargs"):
            options["llm_kwargs"] = {"api_key": "EMPTY"}  # LiteLLM's OpenAI route wants a key; local servers ignore it
        if temperature is not None and _accepts(cls, "temperature"):
            options["temperature"] = temperature
        return HarborAgentSpec(self.name, model, {**options, **self.kwargs})


#: Seconds the preflight gives the agent's model server to answer ``GET {base}/models``.
SERVER_PROBE_TIMEOUT = 5.0


def check_model_server(spec: HarborAgentSpec, *, timeout: float = SERVER_PROBE_TIMEOUT) -> str | None:
    """Probe the model server agent ``spec`` calls before any sandbox starts; its URL, or ``None`` when there is none to probe.

    ``GET {base}/models`` with the agent's API key (:func:`harbor_async.models.serve.served_models`,
    the probe ``eval`` runs on ``--base-url``), bounded by ``timeout``. An agent
    with no base URL of its own (a hosted provider such as ``openai/gpt-x``, at
    the provider's default endpoint) is not probed: there is nothing local to check.
    For synchronous callers (it runs its own event loop).

    Raises:
        harbor_async.models.serve.ServerUnreachableError: no answer, or an answer other than a model list (404, 5xx, ...).
        harbor_async.models.serve.ServerAuthError: the server refused the agent's key (401, 403).
        AgentConfigError: Harbor cannot resolve the agent's connection.
    """
    from functools import partial

    import anyio

    return anyio.run(partial(probe_model_server, spec, timeout=timeout))


async def probe_model_server(spec: HarborAgentSpec, *, timeout: float = SERVER_PROBE_TIMEOUT) -> str | None:
    """:func:`check_model_server` from a running event loop (``eval``: the server the agent calls, ``--ak`` included)."""
    from harbor_async.models.serve import served_models

    endpoint = spec.model_endpoint()
    if endpoint is None:  # the provider's default endpoint: nothing local to check
        return None
    url, key = endpoint
    await served_models(url, api_key=key, timeout=timeout)
    return url


def endpoint_options(cls: type, base_url: str | None, api_key_name: str | None = None) -> dict[str, Any]:
    """The options pointing agent ``cls`` at a model server (``--base-url``, ``--api-key-name``, as ``harbor run`` takes them).

    terminus-2 and agents like it take the URL as ``api_base``; others as Harbor's ``base_url``.
    """
    options: dict[str, Any] = {}
    if base_url is not None:
        options["api_base" if _accepts(cls, "api_base") else "base_url"] = base_url
    if api_key_name is not None:
        options["model_api_key_name"] = api_key_name
    return options


def backend_refusal(cls: type, *, local: bool) -> str | None:
    """Why agent ``cls`` cannot run on this backend at all (one line), or ``None``.

    ``local``: the ``local`` backend (no network; the host's ``/usr`` inside the sandbox).
    """
    if not local:
        return None
    name = _display_name(cls)
    if installs_itself(cls):
        return f"agent {name} installs itself from the internet at setup, and local sandboxes have no network: use -e docker (or another backend with a network)"
    for base in cls.__mro__:
        for tool in HOST_TOOLS.get(base.__name__, ()):
            if shutil.which(tool) is None:
                return (f"agent {name} needs {tool} in the sandbox, and local sandboxes run the host's /usr: "
                        f"install {tool} on this host (apt-get install {tool}, or bash .ci/setup)")  # fmt: skip
    return None


def task_refusals(task: Task, cls: type) -> list[tuple[str, str]]:
    """(feature, reason) for each part of ``task`` that agent ``cls`` cannot run in (empty: it can).

    An agent that installs itself needs the network at setup (the task's
    environment) and to reach its model in every agent phase (each step's).
    """
    from harbor.models.task.config import NetworkMode

    if not installs_itself(cls):
        return []
    found = []
    name = _display_name(cls)
    if task.config.environment.resolve_baseline().network_mode is NetworkMode.NO_NETWORK:  # setup runs under it
        found.append(("[environment] network_mode = 'no-network'", f"agent {name} installs itself from the internet at setup"))
    phases = [("[agent]", task.config.agent), *((f"[steps.{s.name}.agent]", s.agent) for s in task.config.steps or [])]
    for where, phase in phases:  # a phase's own policy (Harbor's precedence: the step's, the task's, the environment's)
        policy = phase.explicit_phase_policy()
        if policy is not None and policy.network_mode is NetworkMode.NO_NETWORK:
            found.append((f"{where} network_mode = 'no-network'", f"agent {name} needs the network to reach its model"))
    return found


def _display_name(cls: type[Any]) -> str:
    try:
        return str(cls.name())  # Harbor's agent name (a static method)
    except Exception:  # noqa: BLE001 - a custom agent whose name() needs an instance
        return cls.__name__
