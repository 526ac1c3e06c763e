"""Registry values a sloppy operator writes: each is refused naming the file, the model (the right one
of several) and the field, before anything starts; `gateway serve` and `check-config` exit 2 with no
traceback. The reading of the file itself is tests/unit/test_config_yaml.py's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config.registry import ConfigError, load_registry
from tests.harness import REPO_ROOT
from tests.unit.test_config_yaml import refusal as file_refusal

TWO = "  - {name: first, engine: transformers, path: x}\n  - {name: second, engine: transformers, path: x}\n"


def registry_with(tmp_path: Path, third: str, server: str = "") -> Path:
    """Three models, the third with `third`'s fields; `server` is the server section's fields."""
    path = tmp_path / "models.yaml"
    fields = [f for f in ("engine: transformers", "path: x") if f.split(":")[0] + ":" not in third]
    entry = ", ".join(["name: third", *fields, *([third] if third else [])])
    text = (f"server: {{{server}}}\n" if server else "") + "models:\n" + TWO + f"  - {{{entry}}}\n"
    path.write_text(text)
    return path


def refusal(path: Path) -> str:
    message = file_refusal(path)
    assert "model 'first'" not in message and "model 'second'" not in message  # the third's error
    return message


@pytest.mark.parametrize(
    ("third", "expected"),
    [
        ("gpus: [true]", "model 'third', field 'gpus': true/false is not a number"),
        ("replicas: 2, replica_gpus: [[0], [true]]", "field 'replica_gpus': true/false is not a number"),
        ("defaults: {max_tokens: true}", "model 'third', field 'defaults.max_tokens': true/false is not"),
        ("limits: {request_timeout_s: true}", "field 'limits.request_timeout_s': true/false is not a number"),
        ("max_seq_len: 100000000000000000000000", "model 'third', field 'max_seq_len': must be at most"),
        ("limits: {max_queued_requests: 100000000000000000000}", "'limits.max_queued_requests': must be at"),
        ("limits: {max_concurrent_jobs: 99999999999}", "field 'limits.max_concurrent_jobs': must be at most"),
        ("limits: {request_timeout_s: .inf}", "field 'limits.request_timeout_s': Input should be a finite"),
        ("idle_unload_s: .inf", "model 'third', field 'idle_unload_s': Input should be a finite number"),
        (
            "defaults: {repetition_penalty: .inf}",
            "field 'defaults.repetition_penalty': Input should be a finite",
        ),
        ("aliases: ['']", "model 'third', field 'aliases.0': '' is not a model name"),
        ("aliases: ['a b']", "model 'third', field 'aliases.0': 'a b' is not a model name"),
        ("aliases: [org/..]", "field 'aliases.0': 'org/..' is not a model name"),
        ("aliases: ['org//m']", "field 'aliases.0': 'org//m' is not a model name"),
        ("aliases: ['..']", "field 'aliases.0': '..' is not a model name"),
        ("path: ''", "model 'third', field 'path': empty"),
        ("replicas: 2, replica_gpus: [[0], [-1]]", "field 'replica_gpus': GPU indices must be distinct"),
        ("replicas: 2, replica_gpus: [[0, 0], [1]]", "field 'replica_gpus': GPU indices must be distinct"),
        (
            "max_seq_len: 256, defaults: {max_tokens: 1024}",
            "field 'defaults.max_tokens': 1024 exceeds max_seq_len",
        ),
        ("max_seq_len: 256", "field 'defaults.max_tokens': 512 (the default) exceeds max_seq_len 256"),
        ("chat_template: templates/nope.jinja", "model 'third', field 'chat_template': "),
        ("chat_template: ''", "model 'third', field 'chat_template': empty"),
        ("task: embed, engine: exllamav2, gpus: [0]", "model 'third', field 'engine': task embed runs"),
        ("replicas: 2, replica_gpus: [[0]]", "model 'third', field 'replica_gpus': replica_gpus needs one"),
        ("aliases: [first]", "model 'third', field 'aliases.0': 'first' already names model #1 ('first')"),
        ("aliases: [x, x]", "model 'third', field 'aliases.1': 'x' already names this model"),
        ("remote: true", "model 'third', field 'remote': a remote model needs server.remote_workers"),
    ],
)
def test_a_bad_value_names_the_model_and_the_field(tmp_path: Path, third: str, expected: str) -> None:
    assert expected in refusal(registry_with(tmp_path, third))


def test_a_duplicate_name_is_reported_on_the_later_model(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models:\n" + TWO + "  - {name: first, engine: transformers, path: x}\n")
    with pytest.raises(ConfigError, match=r"model 'first', field 'name': 'first' already names model #1"):
        load_registry(path)


def test_a_second_startup_model_of_a_group_names_its_load(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    group = "  - {name: %s, engine: transformers, path: x, exclusive_group: g}\n"
    path.write_text("models:\n" + group % "a" + group % "b")
    with pytest.raises(
        ConfigError, match=r"model 'b', field 'load': exclusive_group 'g': models \['a', 'b'\]"
    ):
        load_registry(path)


@pytest.mark.parametrize(
    ("server", "expected"),
    [
        ("host: ''", "server, field 'host': '' is not a host"),
        ("host: 'my host'", "server, field 'host': 'my host' is not a host"),
        ("runtime_dir: /tmp/" + "r" * 100, "server, field 'runtime_dir': longer than 90 bytes"),
        (
            "heartbeat_interval_s: 60, heartbeat_timeout_s: 30",
            "server, field 'heartbeat_timeout_s': 30.0 must",
        ),
        (
            "restart_backoff_s: 60, restart_backoff_max_s: 1",
            "server, field 'restart_backoff_max_s': 1.0 is less",
        ),
        ("responses: {backend: redis}", "server, field 'responses.backend': redis, but server.redis_url"),
        ("shutdown_grace_s: .inf", "server, field 'shutdown_grace_s': Input should be a finite number"),
        ("port: true", "server, field 'port': true/false is not a number"),
        (
            "cluster: {backend: etcd, etcd: {endpoints: ['h:2379']}}",
            "server, field 'cluster.secret_key_file'",
        ),
    ],
)
def test_a_bad_server_value_names_the_field(tmp_path: Path, server: str, expected: str) -> None:
    assert expected in refusal(registry_with(tmp_path, "remote: true", server))


def test_what_stays_accepted(tmp_path: Path) -> None:
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    path = registry_with(
        tmp_path, "aliases: [org/third, v1..2], chat_template: t.jinja, max_seq_len: '${N:-512}'"
    )
    model = load_registry(path, environ={}).models[2]
    assert model.aliases == ["org/third", "v1..2"] and model.max_seq_len == 512
    assert model.chat_template == str(tmp_path / "t.jinja")
    embed = load_registry(registry_with(tmp_path, "task: embed, max_seq_len: 128")).models[2]
    assert embed.max_seq_len == 128  # max_tokens is no embedding's business
    remote = "remote: true, chat_template: on-the-worker-host.jinja"
    server = "remote_workers: {bind: 'tcp://127.0.0.1:5555', secret_key_file: k, authorized_keys_dir: d}"
    # A remote model's workers resolve its template against their own copy of the file.
    assert (
        load_registry(registry_with(tmp_path, remote, server)).models[2].chat_template
        == "on-the-worker-host.jinja"
    )


def gateway(*args: str, port: str | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k not in ("PORT", "HOST", "CONFIG")}
    if port is not None:
        environ["PORT"] = port
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args], capture_output=True, text=True, cwd=REPO_ROOT, env=environ
    )


def test_serve_refuses_a_port_out_of_range_before_starting(tmp_path: Path) -> None:
    config = str(registry_with(tmp_path, ""))
    for result, expected in [
        (gateway("serve", "--config", config, port="http"), "PORT: 'http' is not a port (0 to 65535)"),
        (gateway("serve", "--config", config, "--port", "70000"), "--port: 70000 is not a port"),
        (gateway("serve", "--config", config, "--port", "8101", "--own-port", "-1"), "--own-port: -1 is not"),
    ]:
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_check_config_reports_what_this_host_cannot_use(tmp_path: Path) -> None:
    (tmp_path / "not-a-folder").write_text("")
    long_path = "/tmp/" + "p" * 300  # longer than a file name may be: is_dir() itself would raise
    text = f"server: {{runtime_dir: {tmp_path / 'not-a-folder'}}}\nmodels:\n" + TWO.replace(
        "path: x}", "path: .}"
    )
    config = tmp_path / "models.yaml"
    config.write_text(text + f"  - {{name: third, engine: transformers, path: {long_path}}}\n")
    result = gateway("check-config", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert (
        f"{config}: server, field 'runtime_dir': {tmp_path / 'not-a-folder'} exists and is not a folder"
        in (result.stderr)
    )
    assert f"{config}: model 'third', field 'path': {long_path} is not a folder on this host" in result.stderr
