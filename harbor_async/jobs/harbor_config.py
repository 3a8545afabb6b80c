"""Harbor's job config files (``harbor run -c FILE``), read with Harbor's own code and run by ``harbor-async run``.

A Harbor user's job lives in a YAML or JSON ``JobConfig`` (what ``harbor run
--print-config`` prints). :func:`load_job_config` reads one or several (later
ones override earlier ones) exactly as the installed Harbor does: its own
loader (a file or a GitHub URL), its own merge and legacy migration, its own
``JobConfig`` model, so a file Harbor accepts is accepted here and one it
refuses is refused with Harbor's words. :func:`run_options` maps the config
onto ``run``'s options, Harbor's defaults included (a config that names no
environment runs on docker, 4 at once, with the oracle, as under Harbor).
Every field set to something this project does not honour is refused, one
line naming the field (:class:`JobConfigError`), before anything starts;
unknown fields of a newer Harbor are refused the same way, never ignored.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harbor_async.core.errors import HarborAsyncError

#: Harbor's fields ``run`` takes, each with what it becomes (the rest of a config, when set, is refused).
_TOP = {
    "job_name", "jobs_dir", "n_attempts", "timeout_multiplier", "agent_timeout_multiplier",
    "verifier_timeout_multiplier", "agent_setup_timeout_multiplier", "environment_build_timeout_multiplier",
    "n_concurrent_trials", "debug", "quiet", "environment", "agents", "datasets", "tasks", "retry", "artifacts",
    "verifier",
}  # fmt: skip
_VERIFIER = {"env", "disable"}
_RETRY = {"max_retries", "include_exceptions", "exclude_exceptions"}
_ENVIRONMENT = {
    "type", "import_path", "kwargs", "force_build", "override_cpus", "override_memory_mb", "override_storage_mb",
    "override_gpus", "delete", "mounts",
}  # fmt: skip
_AGENT = {"name", "import_path", "model_name", "base_url", "model_api_key_name", "kwargs", "env"}
_DATASET = {"path", "name", "version", "registry_url", "registry_path", "task_names", "exclude_task_names", "n_tasks"}
_TASK = {"path", "name", "ref"}  # a folder, or a registry task (-t name@ref); not a git task


class JobConfigError(HarborAsyncError):
    """A Harbor job config that cannot be read, or a field of it that ``harbor-async run`` does not honour.

    Attributes:
        field: the config's field (``environment.override_tpu``), or ``None`` for the file as a whole.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def load_job_config(sources: Sequence[str]) -> Any:
    """The ``JobConfig`` of ``sources`` (files or GitHub URLs), merged and validated as the installed Harbor does.

    Raises:
        JobConfigError: a file that cannot be read, is not a mapping, or that Harbor's model refuses.
    """
    from harbor.cli.config_sources import load_config_source, merge_config
    from harbor.models.job.config import JobConfig
    from pydantic import ValidationError
    from yaml import YAMLError

    try:  # Harbor's own merge rules (which lists a later file appends to), where this Harbor has them
        from harbor.cli import jobs as harbor_jobs_cli

        merge_rules: dict[str, Any] = {
            "append_paths": getattr(harbor_jobs_cli, "_APPEND_CONFIG_PATHS", frozenset()),
            "exclusive_groups": getattr(harbor_jobs_cli, "_EXCLUSIVE_CONFIG_GROUPS", {}),
        }
    except ImportError:
        merge_rules = {}
    data: dict[str, Any] = {}
    for source in sources:
        try:
            layer = load_config_source(source)
        except (OSError, ValueError, YAMLError) as exc:
            raise JobConfigError(f"cannot read the job config {source}: {exc}") from None
        if not isinstance(layer, dict):
            raise JobConfigError(f"the job config {source} must hold a mapping")
        try:
            data = merge_config(data, layer, **merge_rules)
        except TypeError:  # a Harbor whose merge takes no rules
            data = merge_config(data, layer)
        except ValueError as exc:
            raise JobConfigError(str(exc)) from None
    try:
        from harbor.models.job.config import migrate_legacy_job_config
    except ImportError:  # a Harbor with no legacy form to migrate
        pass
    else:
        data = migrate_legacy_job_config(data)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in error["loc"])
        raise JobConfigError(error["msg"], where or None) from None


def run_options(config: Any) -> dict[str, Any]:
    """``run``'s option values of a Harbor ``JobConfig`` (by ``run``'s parameter names), Harbor's defaults included.

    Raises:
        JobConfigError: a field set to what ``harbor-async run`` does not honour (named).
    """
    set_fields = config.model_dump(mode="json", exclude_defaults=True)
    _refuse_unknown(set_fields, _TOP, "")
    _refuse_unknown(set_fields.get("environment") or {}, _ENVIRONMENT, "environment.")
    _refuse_unknown(set_fields.get("retry") or {}, _RETRY, "retry.")
    _refuse_unknown(set_fields.get("verifier") or {}, _VERIFIER, "verifier.")
    agents = config.agents or []
    if len(agents) != 1:
        raise JobConfigError("harbor-async run takes one agent (a sweep of models: harbor-async eval)", "agents")
    _refuse_unknown((set_fields.get("agents") or [{}])[0], _AGENT, "agents[0].")
    for index, dataset in enumerate(set_fields.get("datasets") or []):
        _refuse_unknown(dataset, _DATASET, f"datasets[{index}].")
    for index, task in enumerate(set_fields.get("tasks") or []):
        _refuse_unknown(task, _TASK, f"tasks[{index}].")
    options: dict[str, Any] = {
        "job_name": config.job_name, "jobs_dir": Path(config.jobs_dir), "n_attempts": config.n_attempts,
        "n_concurrent": config.n_concurrent_trials, "timeout_multiplier": config.timeout_multiplier,
        "agent_timeout_multiplier": config.agent_timeout_multiplier,
        "verifier_timeout_multiplier": config.verifier_timeout_multiplier,
        "agent_setup_timeout_multiplier": config.agent_setup_timeout_multiplier,
        "environment_build_timeout_multiplier": config.environment_build_timeout_multiplier,
    }  # fmt: skip
    if config.artifacts:
        artifacts = [a if isinstance(a, str) else a.source for a in config.artifacts]
        if any(not isinstance(a, str) and (a.destination or getattr(a, "exclude", None)) for a in config.artifacts):
            raise JobConfigError("an artifact with a destination or exclusions is a task's (task.toml), not a run's", "artifacts")
        options["artifact"] = artifacts
    retry = config.retry
    if retry.max_retries:
        options["max_retries"] = retry.max_retries
    if retry.include_exceptions:
        options["retry_include"] = sorted(retry.include_exceptions)
    if "exclude_exceptions" in (set_fields.get("retry") or {}):
        options["retry_exclude"] = sorted(retry.exclude_exceptions or ())
    if config.verifier.disable:
        options["disable_verification"] = True
    if config.verifier.env:
        options["verifier_env"] = [f"{key}={value}" for key, value in config.verifier.env.items()]
    if config.debug:
        options["debug"] = True
    if config.quiet:
        options["quiet"] = True
    environment = config.environment
    options["env"] = environment.import_path or (environment.type.value if environment.type is not None else "docker")
    if environment.force_build:
        options["force_build"] = True
    if environment.mounts:  # as --mounts takes them: read-only unless --mounts-writable is given too
        options["mounts"] = _text(list(environment.mounts))
    options["delete"] = bool(environment.delete)  # Harbor's default (true) included: a file is run as Harbor runs it
    for name in ("override_cpus", "override_memory_mb", "override_storage_mb", "override_gpus"):
        if getattr(environment, name, None) is not None:
            options[name] = getattr(environment, name)
    if environment.kwargs:
        options["ek"] = [f"{key}={_text(value)}" for key, value in environment.kwargs.items()]
    options.update(_agent_options(agents[0]))
    options.update(_selection(config))
    return options


def _agent_options(agent: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"agent": agent.import_path or agent.name or "oracle"}
    if agent.model_name:
        options["model"] = agent.model_name
    if agent.base_url:
        options["base_url"] = agent.base_url
    if agent.model_api_key_name:
        options["api_key_name"] = agent.model_api_key_name
    if agent.kwargs:
        options["ak"] = [f"{key}={_text(value)}" for key, value in agent.kwargs.items()]
    if agent.env:
        options["agent_env"] = [f"{key}={value}" for key, value in agent.env.items()]
    return options


def _selection(config: Any) -> dict[str, Any]:
    """Where the tasks come from: one dataset (a folder or the registry's ``name@version``), one task folder, or one
    registry task (``name``/``ref``: ``-t``)."""
    datasets, tasks = config.datasets or [], config.tasks or []
    if len(datasets) + len(tasks) != 1:
        raise JobConfigError("harbor-async run takes one dataset or one task (give -p, -d or -t)", "datasets")
    if tasks:
        task = tasks[0]  # a git task (git_url) was refused above, with the other fields run does not take
        if task.name is not None:  # harbor run -t: a registry task (a --registry-path given beside -c is its registry)
            return {"task_ref": f"{task.name}@{task.ref}" if task.ref else task.name}
        return {"path": Path(task.path)}
    dataset = datasets[0]
    found: dict[str, Any] = {}
    if dataset.path is not None:
        found["path"] = Path(dataset.path)
    else:
        found["dataset"] = f"{dataset.name}@{dataset.version}" if dataset.version else dataset.name
        if dataset.registry_url:
            found["registry_url"] = dataset.registry_url
        if dataset.registry_path:
            found["registry_path"] = Path(dataset.registry_path)
    if dataset.task_names:
        found["include"] = list(dataset.task_names)
    if dataset.exclude_task_names:
        found["exclude"] = list(dataset.exclude_task_names)
    if dataset.n_tasks:
        found["n_tasks"] = dataset.n_tasks
    return found


def _refuse_unknown(values: dict[str, Any], taken: set[str], prefix: str) -> None:
    for name in values:
        if name not in taken:
            raise JobConfigError("not honoured by harbor-async run (see docs/cli.md, Harbor's job configs)", prefix + name)


def _text(value: Any) -> str:
    """A kwarg's value as ``--ak``/``--ek`` take it (JSON for what is not a plain string)."""
    import json

    return value if isinstance(value, str) else json.dumps(value)
