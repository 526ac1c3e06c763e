"""Chat template rendering with Hugging Face's semantics, in a sandboxed Jinja2 environment.

Runs in the worker process, which owns the tokenizer files. Reads `bos_token` and `eos_token`
from the model's tokenizer_config.json, and the template from `chat_template.jinja` (where
transformers 5 saves it) or else tokenizer_config.json's `chat_template`, unless the registry
overrides the template (inline text or a file path).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wire.params import RESERVED_TEMPLATE_VARIABLES  # what chat_template_kwargs may not replace


class TemplateError(ValueError):
    """The messages cannot be rendered by this model's template (a client error)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _token_text(value: Any) -> str:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return str(value or "")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        # Same environment options as transformers' apply_chat_template, so templates written
        # for Hugging Face render identically here.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        parsed = env.parse(source)
        # A template that never reads `tools` would drop them silently: such a model cannot take tools.
        self.supports_tools = "tools" in jinja2.meta.find_undeclared_variables(parsed)
        # Nor can one that never reads a message's `tool_calls` take a history holding calls: it would
        # drop them and show the model results of calls it never made.
        self.renders_tool_calls = any(
            _names_tool_calls(node) for node in parsed.find_all((nodes.Getattr, nodes.Getitem))
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text. `continue_final_message` leaves the last message open for the model to
        go on with (Hugging Face's semantics: the text is cut right after that message's content)."""
        reserved = RESERVED_TEMPLATE_VARIABLES & set(extra or {})
        if reserved:
            raise TemplateError(f"chat_template_kwargs may not set {sorted(reserved)}")
        try:
            text = self._template.render(
                **(extra or {}),
                messages=messages,
                tools=tools or None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise TemplateError(f"chat template failed: {exc}") from None
        if continue_final_message:
            final = str(messages[-1].get("content") or "").strip() if messages else ""
            if not final or final not in text:
                raise TemplateError("continue_final_message needs a final message with text content")
            text = text[: text.rindex(final) + len(final)]
        return text

    @classmethod
    def for_model(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate | None:
        """The registry override (a file path or inline Jinja) wins over tokenizer_config.json."""
        config_path = Path(model_dir) / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            config = json.loads(config_path.read_text())
        source = config.get("chat_template")
        if isinstance(source, list):  # newer HF files hold named templates
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        template_file = Path(model_dir) / "chat_template.jinja"
        if template_file.is_file():  # as in transformers, the separate file wins over the config entry
            source = template_file.read_text(encoding="utf-8")
        if override:
            override_path = Path(override)
            is_file = "{" not in override and override_path.is_file()
            source = override_path.read_text() if is_file else override
        if not source:
            return None
        return cls(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))


def _names_tool_calls(node: nodes.Node) -> bool:
    """`message.tool_calls` or `message['tool_calls']`."""
    if isinstance(node, nodes.Getattr):
        return bool(node.attr == "tool_calls")
    item = node.arg if isinstance(node, nodes.Getitem) else None
    return isinstance(item, nodes.Const) and item.value == "tool_calls"
