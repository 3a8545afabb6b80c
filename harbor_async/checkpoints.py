"""The models of an evaluation and the servers that serve them.

A model is a name on a server, a checkpoint folder, or a LoRA adapter;
checkpoints named ``checkpoint-<step>`` sort by step. LoRA adapters of one base
share one managed vLLM server; any other checkpoint gets its own.
"""

from __future__ import annotations

import functools
import glob
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harbor_async import serve as _serve
from harbor_async.errors import EvalConfigError


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


_STEP = re.compile(r"(\d+)\D*$")
_GLOB = re.compile(r"[*?\[]")


def checkpoint_step(name: str) -> int | None:
    """The last number in a checkpoint's base name (``ckpts/checkpoint-400`` -> 400)."""
    match = _STEP.search(Path(name.rstrip("/")).name)
    return int(match.group(1)) if match else None


def resolve_models(models: Sequence[str]) -> list[ModelSpec]:
    """Expand globs (``ckpts/checkpoint-*``), sort each glob's matches by step, drop repeats.

    A glob that matches nothing is an error; a plain name is kept as given
    (a served model name or a checkpoint folder).
    """
    specs: list[ModelSpec] = []
    for model in models:
        if _GLOB.search(model):
            matches = glob.glob(model)
            if not matches:
                raise EvalConfigError(f"no checkpoint matches {model!r}")
            ordered = sorted(matches, key=lambda m: (checkpoint_step(m) is None, checkpoint_step(m) or 0, m))
            names = ordered
        else:
            names = [model]
        for name in names:
            if all(s.name != name for s in specs):
                specs.append(ModelSpec(name=name, checkpoint=name, step=checkpoint_step(name)))
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
                    lambda port, s=spec: _serve.vllm_command(
                        s.checkpoint, port, served_name=s.name, extra_args=list(vllm_args)
                    ),
                )
            )
    for base, adapters in by_base.items():
        groups.append(
            ServerGroup(
                adapters,
                lambda port, b=base, a=adapters: _serve.vllm_command(
                    b, port, lora_adapters={s.name: s.checkpoint for s in a}, extra_args=list(vllm_args)
                ),
            )
        )
    return groups
