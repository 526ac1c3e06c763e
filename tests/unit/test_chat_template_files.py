"""Where a model folder keeps its chat template: transformers 5 writes `chat_template.jinja`.

Runs in the pytest process on folders written to tmp: the worker's template reader must find the
separate file (a folder saved by transformers 5 has no template in tokenizer_config.json), prefer
it over the config entry as transformers does, and still yield to the registry's override.
"""

from __future__ import annotations

import json
from pathlib import Path

from model_worker.chat_template import ChatTemplate

MESSAGES = [{"role": "user", "content": "hi"}]


def _folder(tmp_path: Path, config_template: str | None, file_template: str | None) -> Path:
    config = {"bos_token": "<s>", "eos_token": "</s>"}
    if config_template is not None:
        config["chat_template"] = config_template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if file_template is not None:
        (tmp_path / "chat_template.jinja").write_text(file_template, encoding="utf-8")
    return tmp_path


def test_template_file_written_by_transformers_5_is_read(tmp_path: Path) -> None:
    folder = _folder(tmp_path, None, "{{ bos_token }}[{{ messages[0]['content'] }}]")
    template = ChatTemplate.for_model(folder)
    assert template is not None and template.render(MESSAGES) == "<s>[hi]"


def test_the_file_wins_over_the_config_entry_and_the_registry_over_both(tmp_path: Path) -> None:
    folder = _folder(tmp_path, "config:{{ messages[0]['content'] }}", "file:{{ messages[0]['content'] }}")
    template = ChatTemplate.for_model(folder)
    assert template is not None and template.render(MESSAGES) == "file:hi"
    override = ChatTemplate.for_model(folder, "registry:{{ messages[0]['content'] }}")
    assert override is not None and override.render(MESSAGES) == "registry:hi"


def test_a_folder_without_any_template_has_none(tmp_path: Path) -> None:
    assert ChatTemplate.for_model(_folder(tmp_path, None, None)) is None


def test_a_template_renders_tool_calls_only_where_it_reads_them() -> None:
    plain = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    by_attribute = "{% for m in messages %}{{ m.content }}{% for c in m.tool_calls or [] %}{{ c }}{% endfor %}{% endfor %}"  # noqa: E501
    by_item = "{% for m in messages %}{% if m['tool_calls'] is defined %}{{ m['tool_calls'] | tojson }}{% endif %}{% endfor %}"  # noqa: E501
    assert not ChatTemplate(plain).renders_tool_calls
    assert ChatTemplate(by_attribute).renders_tool_calls and ChatTemplate(by_item).renders_tool_calls
    repository = Path(__file__).resolve().parents[2] / "config" / "templates" / "smollm2-tools.jinja"
    assert ChatTemplate(repository.read_text()).renders_tool_calls
