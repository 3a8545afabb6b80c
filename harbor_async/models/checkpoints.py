"""The models of an evaluation and the servers that serve them.

A model is a name on a server, a checkpoint folder, or a LoRA adapter;
checkpoints named ``checkpoint-<step>`` (or ``step-<step>``) sort by step. LoRA adapters of one base
share one managed vLLM server; any other checkpoint gets its own.
"""

from __future__ import annotations

import functools
import glob
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harbor_async.core.errors import EvalConfigError
from harbor_async.models import serve as _serve


@dataclass(frozen=True)
class ModelSpec:
    """One policy of an evaluation.

    Attributes:
        name: the model name requests carry, and the record's ``model``.
        checkpoint: the checkpoint folder (managed server) or the name again.
        step: the training step, read from the name (``checkpoint-400`` -> 400).
    """

    name: str
    checkpoint: str
    step: int | None = None


#: Checkpoint folder names a step is read from: TRL's ``checkpoint-400``, ``step-400`` / ``step_400``, verl's
#: ``global_step_400``. Any other name has no step (``models/tiny-qwen3`` is not "step 3").
CHECKPOINT_NAME = re.compile(r"(?:checkpoint|step|global_step)[-_](\d+)")
_GLOB = re.compile(r"[*?\[]")


def checkpoint_step(name: str, step_from: str | re.Pattern[str] | None = None) -> int | None:
    """The training step a checkpoint folder's base name says (``ckpts/checkpoint-400`` -> 400), else ``None``.

    ``step_from``: a regular expression whose first group is the step, matched
    against the whole base name, for names of another trainer's making
    (default :data:`CHECKPOINT_NAME`).
    """
    pattern = re.compile(step_from) if isinstance(step_from, str) else step_from or CHECKPOINT_NAME
    match = pattern.fullmatch(Path(name.rstrip("/")).name)
    return int(match.group(1)) if match and match.groups() and match.group(1) is not None else None


def step_pattern(text: str) -> re.Pattern[str]:
    """``--step-from``'s regular expression, checked: it must compile and have a group for the step.

    Raises:
        EvalConfigError: it does not.
    """
    try:
        pattern = re.compile(text)
    except re.error as exc:
        raise EvalConfigError(f"--step-from {text!r} is not a regular expression: {exc}") from None
    if pattern.groups < 1:
        raise EvalConfigError(f"--step-from {text!r} has no group: put the step's digits in one, e.g. 'ckpt(\\d+)'")
    return pattern


def resolve_models(models: Sequence[str], step_from: str | re.Pattern[str] | None = None) -> list[ModelSpec]:
    """Expand globs (``ckpts/checkpoint-*``), sort each glob's matches by step, drop repeats.

    A glob that matches nothing is an error; a plain name is kept as given
    (a served model name or a checkpoint folder). Steps are read as
    :func:`checkpoint_step` reads them (``step_from``: another pattern).
    """
    step = functools.partial(checkpoint_step, step_from=step_from)
    specs: list[ModelSpec] = []
    for model in models:
        if _GLOB.search(model):
            matches = glob.glob(model)
            if not matches:
                raise EvalConfigError(f"no checkpoint matches {model!r}")
            ordered = sorted(matches, key=lambda m: (step(m) is None, step(m) or 0, m))
            names = ordered
        else:
            names = [model]
        for name in names:
            if all(s.name != name for s in specs):
                specs.append(ModelSpec(name=name, checkpoint=name, step=step(name)))
    if not specs:
        raise EvalConfigError("no model to evaluate: pass at least one -m")
    return specs


@dataclass
class ServerGroup:
    """Models one server serves; ``command`` is ``None`` for a server we do not manage."""

    models: list[ModelSpec]
    command: Callable[[int], list[str]] | None = None
    check_names: bool = True


def server_groups(
    specs: list[ModelSpec], *, base_url: str | None, serve_cmd: str | None, vllm_args: Sequence[str] = ()
) -> list[ServerGroup]:
    """The servers an evaluation needs: one given URL, one ``serve_cmd`` server per model, or managed vLLM servers."""
    if base_url:
        return [ServerGroup(specs)]
    if serve_cmd:
        template = serve_cmd
        _serve.format_serve_cmd(template, "m", 0)  # checks {port} now, before any sandbox
        # The command was handed the model: its listing may name it differently (a path, a hub id).
        return [
            ServerGroup([s], functools.partial(_serve.format_serve_cmd, template, s.checkpoint), check_names=False)
            for s in specs
        ]
    # Managed vLLM: LoRA adapters of one base share a server; any other checkpoint gets its own.
    groups: list[ServerGroup] = []
    by_base: dict[str, list[ModelSpec]] = {}
    for spec in specs:
        base = _serve.lora_base(spec.checkpoint)
        if base is not None:
            by_base.setdefault(base, []).append(spec)
        else:
            groups.append(
                ServerGroup(
                    [spec],
                    lambda port, s=spec: _serve.vllm_command(  # type: ignore[misc]  # mypy infers no lambda with defaults
                        s.checkpoint, port, served_name=s.name, extra_args=list(vllm_args)
                    ),
                )
            )
    for base, adapters in by_base.items():
        groups.append(
            ServerGroup(
                adapters,
                lambda port, b=base, a=adapters: _serve.vllm_command(  # type: ignore[misc]  # mypy infers no lambda with defaults
                    b, port, lora_adapters={s.name: s.checkpoint for s in a}, extra_args=list(vllm_args)
                ),
            )
        )
    return groups
