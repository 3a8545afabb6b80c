"""``harbor run``'s flags that ``harbor-async run`` does not honour, each with the reason, refused up front.

A user who swaps ``harbor run`` for ``harbor-async run`` keeps the command line;
a flag whose meaning we cannot honour is refused in one line that says why,
before anything starts, instead of Click's bare "no such option" (or, worse,
being ignored). The flags both commands take are ``run``'s own options (see
``docs/cli.md``, "Every flag of harbor run"); ``tests/test_harbor_flags.py``
checks that every flag of the installed Harbor's ``harbor run`` is one or the
other, and that the docs list it.
"""

from __future__ import annotations

from collections.abc import Sequence

_HUB = "Harbor Hub's hosted service (hosted runs, upload, sharing, secrets); the job folder is in Harbor's format: `harbor upload JOB_DIR`"
_USER = "simulated-user (multi-turn) trials are not run by harbor-async"
_EXPORT = "trace export runs on Harbor's job folder afterwards: `harbor traces export` on the job folder (Harbor's format)"

#: Each refused flag (every spelling) -> why.
REFUSED: dict[tuple[str, ...], str] = {
    ("--diff",): "comparing against an earlier job is Harbor's `harbor run --diff`; `harbor-async run --resume JOB_DIR` reruns what failed",
    ("--n-concurrent-agents",): "one concurrency limit, -n, bounds the episodes (and so the agents) of a run",
    ("--api-format",): "Harbor agents get the model server through --ak (e.g. api_base); the API format is the agent's own",
    ("--skip-model-parsing-and-provider-mapping", "--sm"): "the model name is passed to the agent as given",
    ("--effort",): "pass the agent's own reasoning-effort kwarg with --ak",
    ("--allow-agent-host",): "per-phase host allowlists need Harbor's egress sidecar; harbor-async refuses allowlist network policies up front",
    ("--allow-environment-host",): "per-phase host allowlists need Harbor's egress sidecar; harbor-async refuses allowlist network policies up front",
    ("--allow-verifier-host",): "per-phase host allowlists need Harbor's egress sidecar; harbor-async refuses allowlist network policies up front",
    ("--resume-trajectory",): "multi-step sessions of an agent's own are not resumed between steps",
    ("--load-trajectory",): "loading an agent session is not supported",
    ("--agent-include-logs",): "the agent's whole log folder is kept in the trial folder",
    ("--agent-exclude-logs",): "the agent's whole log folder is kept in the trial folder",
    ("--mcp-config",): "MCP servers come from the task's [environment] mcp_servers (a Harbor agent wires them; eval's and TRL's tool harnesses refuse such tasks up front)",
    ("--skill", "--skills"): "skills come from the task's skills_dir (a Harbor agent gets them; eval's and TRL's tool harnesses refuse such tasks up front)",
    ("--user-agent",): _USER,
    ("--user-model",): _USER,
    ("--uk", "--user-agent-kwarg"): _USER,
    ("--user-persona-path",): _USER,
    ("--user-prompt-template-path",): _USER,
    ("--bridge",): _USER,
    ("--bridge-prompt-path",): _USER,
    ("--bk", "--bridge-kwarg"): _USER,
    ("--stream", "--no-stream"): "live trajectory sync and VS Code over SSH are Harbor Hub features",
    ("--cpus",): "task.toml's cpus are enforced as limits (docker: Compose limits; local: cgroups)",
    ("--memory",): "task.toml's memory is enforced as a limit (docker: Compose limits; local: cgroups)",
    ("--override-tpu",): "TPU tasks are refused up front where the backend has none",
    ("--extra-docker-compose",): "Compose overlays are harbor-async's own (labels, init, limits); a task's docker-compose.yaml is honoured",
    ("--verifier-include-logs",): "the verifier's whole log folder is kept in the trial folder",
    ("--verifier-exclude-logs",): "the verifier's whole log folder is kept in the trial folder",
    ("--verifier",): "the task's own verifier judges every episode (a custom verifier class is not run)",
    ("--verifier-import-path",): "deprecated by Harbor: see --verifier",
    ("--verifier-kwarg",): "the task's own verifier judges every episode (a custom verifier class is not run)",
    ("--install-only",): "agents are installed in each episode's sandbox, not ahead of a run",
    ("--extra-instruction-path",): "the instruction is the task's own, as training sees it",
    ("--extra-instruction",): "the instruction is the task's own, as training sees it",
    ("--task-git-url",): "tasks come from -p, -d or -t",
    ("--task-git-commit",): "tasks come from -p, -d or -t",
    ("--export-traces", "--no-export-traces"): _EXPORT,
    ("--export-sharegpt", "--no-export-sharegpt"): _EXPORT,
    ("--export-episodes",): _EXPORT,
    ("--export-push", "--no-export-push"): _EXPORT,
    ("--export-repo",): _EXPORT,
    ("--export-instruction-metadata", "--no-export-instruction-metadata"): _EXPORT,
    ("--export-verifier-metadata", "--no-export-verifier-metadata"): _EXPORT,
    ("--plugin",): "Harbor's job plugins hook Harbor's own job runner, which harbor-async replaces",
    ("--pk", "--plugin-kwarg"): "Harbor's job plugins hook Harbor's own job runner, which harbor-async replaces",
    ("--repo",): "git registries: clone the repository and give its registry.json with --registry-path",
    ("--upload",): _HUB,
    ("--launch",): _HUB,
    ("--skip-credential-checks",): "harbor-async checks no agent credentials before a run",
    ("--use-static-ip",): _HUB,
    ("--credential-mode",): _HUB,
    ("--one-off-secret",): _HUB,
    ("--stored-secret",): _HUB,
    ("--no-secrets",): _HUB,
    ("--registry-secret",): _HUB,
    ("--public", "--private"): _HUB,
    ("--share",): _HUB,
    ("--share-user",): _HUB,
    ("--org",): _HUB,
    ("--server",): "a Harbor rollout server runs Harbor's own job runner; run harbor-async on that machine instead",
    ("--watch",): "a Harbor rollout server runs Harbor's own job runner; run harbor-async on that machine instead",
}

_BY_SPELLING = {spelling: reason for spellings, reason in REFUSED.items() for spelling in spellings}


def refusal(args: Sequence[str]) -> str | None:
    """The line refusing the first ``harbor run`` flag in ``args`` that ``harbor-async run`` does not honour, if any."""
    for arg in args:
        if arg == "--":
            break
        flag = arg.split("=", 1)[0]
        reason = _BY_SPELLING.get(flag)
        if reason is not None:
            return f"{flag} (a `harbor run` flag) is not honoured by harbor-async run: {reason}"
    return None
