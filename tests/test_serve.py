"""The managed server's command lines (vLLM is never run here) and the model resolution of a sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harbor_async.core.errors import EvalConfigError
from harbor_async.models.checkpoints import (
    checkpoint_step,
    resolve_models,
    server_groups,
    step_pattern,
)
from harbor_async.models.serve import (
    ServeError,
    format_serve_cmd,
    lora_base,
    tool_call_parser_for,
    vllm_command,
)


def _checkpoint(path: Path, template: str = "", model_type: str = "qwen3") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return path


def test_vllm_command_enables_tool_calling_with_the_template_parser(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "qwen", "{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}")
    cmd = vllm_command(ckpt, 8123, served_name="ckpt-100", extra_args=["--max-model-len", "8192"])
    assert cmd[:3] == ["vllm", "serve", str(ckpt)]
    assert cmd[cmd.index("--port") + 1] == "8123" and cmd[cmd.index("--host") + 1] == "127.0.0.1"
    assert "--enable-auto-tool-choice" in cmd
    assert cmd[cmd.index("--tool-call-parser") + 1] == "hermes"
    assert cmd[cmd.index("--served-model-name") + 1] == "ckpt-100"
    assert cmd[-2:] == ["--max-model-len", "8192"] and "--enable-lora" not in cmd


@pytest.mark.parametrize(
    ("template", "model_type", "parser"),
    [
        ("[TOOL_CALLS] {{ tools }}", "mistral", "mistral"),
        ("<|python_tag|>{{ x }}", "llama", "llama3_json"),
        ("", "llama", "llama3_json"),
        ("", "qwen2", "hermes"),
        ("", "unknown", "hermes"),
    ],
)
def test_tool_call_parser_follows_the_chat_template(tmp_path: Path, template, model_type, parser) -> None:
    assert tool_call_parser_for(_checkpoint(tmp_path / "m", template, model_type)) == parser


def test_chat_template_file_is_read(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "m", "", "unknown")
    (ckpt / "chat_template.jinja").write_text("[TOOL_CALLS]")
    assert tool_call_parser_for(ckpt) == "mistral"


def test_lora_adapters_share_one_server(tmp_path: Path) -> None:
    base = _checkpoint(tmp_path / "base", "<tool_call>")
    adapters = []
    for step in (200, 100):
        adapter = tmp_path / "ckpts" / f"checkpoint-{step}"
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(base)}))
        adapters.append(adapter)
    assert lora_base(adapters[0]) == str(base) and lora_base(base) is None
    specs = resolve_models([str(tmp_path / "ckpts" / "checkpoint-*")])
    assert [s.step for s in specs] == [100, 200]  # sorted by step, not by name
    groups = server_groups(specs, base_url=None, serve_cmd=None)
    assert len(groups) == 1 and [s.step for s in groups[0].models] == [100, 200]
    cmd = groups[0].command(9000)
    assert cmd[:3] == ["vllm", "serve", str(base)] and "--enable-lora" in cmd
    modules = cmd[cmd.index("--lora-modules") + 1 : cmd.index("--lora-modules") + 3]
    assert modules == [f"{s.name}={s.checkpoint}" for s in specs]


def test_full_checkpoints_get_a_server_each(tmp_path: Path) -> None:
    for step in (10, 2):
        _checkpoint(tmp_path / f"checkpoint-{step}", "<tool_call>")
    specs = resolve_models([str(tmp_path / "checkpoint-*")])
    groups = server_groups(specs, base_url=None, serve_cmd=None)
    assert [g.models[0].step for g in groups] == [2, 10]
    assert groups[1].command(1)[2] == str(tmp_path / "checkpoint-10")


def test_serve_cmd_puts_model_and_port_in_each_word() -> None:
    cmd = format_serve_cmd("transformers serve {model} --port {port} --host 127.0.0.1", "/m/a b", 8000)
    assert cmd == ["transformers", "serve", "/m/a b", "--port", "8000", "--host", "127.0.0.1"]
    with pytest.raises(ServeError, match="port"):
        format_serve_cmd("serve {model}", "m", 1)


def test_model_names_and_steps() -> None:
    assert checkpoint_step("ckpts/checkpoint-400") == 400
    assert checkpoint_step("ckpts/checkpoint-400/") == 400
    assert checkpoint_step("runs/step-12") == checkpoint_step("runs/step_12") == checkpoint_step("global_step_12") == 12
    # A number in a model's name is not a step (it was: "step 3" of tiny-qwen3, "step 7" of this one).
    assert checkpoint_step("models/tiny-qwen3") is None and checkpoint_step("Qwen/Qwen3-8B-step7-final") is None
    assert checkpoint_step("solver") is None
    assert checkpoint_step("run/ckpt0040", step_from=step_pattern(r"ckpt(\d+)")) == 40
    assert checkpoint_step("run/checkpoint-40", step_from=step_pattern(r"ckpt(\d+)")) is None
    with pytest.raises(EvalConfigError, match="no group"):
        step_pattern(r"ckpt\d+")
    specs = resolve_models(["b", "a", "b"])
    assert [s.name for s in specs] == ["b", "a"]
    with pytest.raises(ValueError, match="no checkpoint matches"):
        resolve_models(["/nonexistent/checkpoint-*"])
