"""Reading registry and keys files: text, YAML and alias problems are clear errors naming the file and,
where a value is at fault, the model and the field; never a traceback, a hang or a silent last-key-wins."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gateway.config.api_keys import parse_keys_file
from gateway.config.registry import ConfigError, load_registry

ENTRY = "  - {name: %s, engine: transformers, path: x}\n"
THREE = "models:\n" + ENTRY % "first" + ENTRY % "second"


def write(tmp_path: Path, text: str | bytes, name: str = "models.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    return message


def nested_anchors(levels: int, width: int) -> str:
    """A flow list whose last item, written in a few lines, expands to width**levels strings."""
    items = [f"&l0 [{', '.join(['x'] * width)}]"]
    items += [f"&l{n} [{', '.join([f'*l{n - 1}'] * width)}]" for n in range(1, levels)]
    return "[" + ", ".join(items) + "]"


def test_text_that_is_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, b"# caf\xe9\n" + THREE.encode())
    assert "not UTF-8 text: byte 0xe9 at line 1" in refusal(path)


@pytest.mark.parametrize(
    ("third", "expected"),
    [
        (
            "  - {name: third, engine: transformers, path: x, limits: {max_queued_requests: 1, "
            "max_queued_requests: 2}}\n",
            "model 'third', field 'limits.max_queued_requests': 'max_queued_requests' is given twice",
        ),
        (
            "  - name: third\n    engine: transformers\n    path: x\n    path: y\n",
            "model 'third', field 'path': 'path' is given twice (lines 6 and 7)",
        ),
    ],
)
def test_a_key_given_twice_names_the_model_and_the_field(tmp_path: Path, third: str, expected: str) -> None:
    assert expected in refusal(write(tmp_path, THREE + third))


def test_a_second_models_list_is_not_silently_kept_alone(tmp_path: Path) -> None:
    message = refusal(write(tmp_path, THREE + "models:\n" + ENTRY % "third"))
    assert "field 'models': 'models' is given twice (lines 1 and 4)" in message


def test_merge_keys_and_anchors_still_load(tmp_path: Path) -> None:
    text = (
        "models:\n  - {name: first, engine: transformers, path: x, defaults: &d {temperature: 0.3}}\n"
        "  - {name: second, engine: transformers, path: x, defaults: {<<: *d, temperature: 0.5}}\n"
        "  - {name: third, engine: transformers, path: x, defaults: *d}\n"
    )
    registry = load_registry(write(tmp_path, text))
    assert [m.defaults.temperature for m in registry.models] == [0.3, 0.5, 0.3]


@pytest.mark.timeout(30)
def test_an_alias_bomb_is_refused_at_once(tmp_path: Path) -> None:
    # 6**7 (280 thousand) strings, in a few lines: expanded, a larger one would never finish.
    text = "server:\n  allowed_hosts: " + nested_anchors(7, 6) + "\n" + THREE
    started = time.monotonic()
    message = refusal(write(tmp_path, text))
    assert "line 2: more than 100000 values" in message
    assert time.monotonic() - started < 5


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("server:\n  allowed_hosts: &h [*h]\n" + THREE, "line 2: an alias refers to a value that contains"),
        (  # each alias one level deeper than the one it names: shallow text, deep data
            "server:\n  allowed_hosts: ["
            + ", ".join(["&a0 [x]", *(f"&a{n} [*a{n - 1}]" for n in range(1, 500))])
            + "]\n"
            + THREE,
            "nested deeper than 64 levels once aliases are expanded",
        ),
        ("models: " + "[" * 5000 + "]" * 5000 + "\n", "not valid YAML at line 1: nested deeper than 64"),
    ],
    ids=["cycle", "alias-chain", "deep-text"],
)
def test_nesting_that_would_exhaust_recursion_is_refused(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in refusal(write(tmp_path, text))


@pytest.mark.parametrize(
    ("third", "expected"),
    [
        ('{name: third, engine: transformers, path: "m\\0"}', "model 'third', field 'path': a NUL"),
        ('{name: third, engine: transformers, path: x, env: {A: "\\0"}}', "model 'third', field 'env.A'"),
        ('{name: third, engine: transformers, path: x, chat_template: "\\0"}', "'chat_template': a NUL"),
    ],
)
def test_a_nul_character_is_refused_where_it_is(tmp_path: Path, third: str, expected: str) -> None:
    assert expected in refusal(write(tmp_path, THREE + f"  - {third}\n"))


def test_a_server_path_with_a_nul_character(tmp_path: Path) -> None:
    text = 'server: {model_cache_dir: "c\\0"}\n' + THREE
    assert "server, field 'model_cache_dir': a NUL character" in refusal(write(tmp_path, text))


def test_a_character_yaml_forbids_names_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, THREE + '  - {name: third, engine: transformers, path: "a\x01"}\n')
    assert "not valid YAML at line 4: character #x0001" in refusal(path)


def test_a_file_too_large_to_be_a_registry(tmp_path: Path) -> None:
    path = write(tmp_path, THREE + "# " + "x" * (4 * 1024 * 1024) + "\n")
    assert "larger than 4 MiB" in refusal(path)


def test_the_keys_file_is_read_the_same_way(tmp_path: Path) -> None:
    registry = load_registry(write(tmp_path, THREE))
    latin1 = b"keys:\n  - {name: \xe9, key: aaaaaaaaaaaaaaaaaaaa, models: ['*']}\n"
    keys = write(tmp_path, latin1, "keys.yaml")
    with pytest.raises(ConfigError, match=r"keys.yaml: not UTF-8 text: byte 0xe9 at line 2"):
        parse_keys_file(keys, registry)
    twice = "keys:\n  - {name: a, key: aaaaaaaaaaaaaaaaaaaa, models: ['*']}\nkeys: []\n"
    with pytest.raises(ConfigError, match=r"field 'keys': 'keys' is given twice \(lines 1 and 3\)"):
        parse_keys_file(write(tmp_path, twice, "keys.yaml"), registry)
