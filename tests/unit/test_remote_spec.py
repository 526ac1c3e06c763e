"""A remote worker reads its own copy of the registry file: what the gateway would refuse, the worker
refuses too, with an error naming the file, the model and the field; never a traceback, a coerced
value (`true` as 1) or a guess; and the file is read within the gateway's bounds (wire.yaml_file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config.registry import ConfigError, load_registry
from model_worker.etcd_target import RegistrationConfigError, etcd_target
from model_worker.remote_spec import RemoteSpecError, remote_spec

# A remote model needs a place where its workers connect.
SERVER = "server: {%scluster: {backend: etcd, etcd: {endpoints: ['127.0.0.1:2379']}}}\n"
ENTRY = SERVER % "" + "models:\n  - {name: m, engine: transformers, path: x, remote: true%s}\n"


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "x").mkdir(exist_ok=True)
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (", max_seq_len: abc", "max_seq_len"),
        (", max_seq_len: true", "max_seq_len"),
        (", max_seq_len: -5", "max_seq_len"),
        (", env: [A, B]", "env"),
        (", env: {A: 1}", "env"),
        (", task: 7", "task"),
        (", task: rerank", "task"),
        (", chat_template: 5", "chat_template"),
        (", load: later", "load"),
        (", limits: {max_concurrent_jobs: 0}", "limits.max_concurrent_jobs"),
        (", limits: {worker_queued_jobs: three}", "limits.worker_queued_jobs"),
        (", limits: {max_constraint_states: abc}", "limits.max_constraint_states"),
        (", limits: {max_constraint_compile_s: .inf}", "limits.max_constraint_compile_s"),
        (", limits: {burst_gather_ms: true}", "limits.burst_gather_ms"),
    ],
)
def test_a_bad_value_is_refused_by_the_worker_as_by_the_gateway(
    tmp_path: Path, extra: str, field: str
) -> None:
    path = write(tmp_path, ENTRY % extra)
    with pytest.raises(ConfigError, match=f"model 'm', field '{field}"):
        load_registry(path)
    with pytest.raises(RemoteSpecError) as caught:
        remote_spec(path, "m")
    message = str(caught.value)
    assert message.startswith(f"{path}: model 'm', field {field!r}: "), message


def test_the_server_section_is_checked_by_type_and_against_itself(tmp_path: Path) -> None:
    path = write(tmp_path, "server: [1]\n" + ENTRY.removeprefix(SERVER % "") % "")
    with pytest.raises(RemoteSpecError, match=r"models.yaml: server: Expected object, got array"):
        remote_spec(path, "m")
    path = write(tmp_path, ENTRY.replace("{", "{heartbeat_interval_s: soon, ", 1) % "")
    with pytest.raises(RemoteSpecError, match=r"server, field 'heartbeat_interval_s': Expected float"):
        remote_spec(path, "m")
    path = write(tmp_path, ENTRY.replace("{", "{heartbeat_interval_s: 5, heartbeat_timeout_s: 2, ", 1) % "")
    with pytest.raises(RemoteSpecError, match=r"field 'heartbeat_timeout_s': 2.0 must exceed"):
        remote_spec(path, "m")


def test_a_model_that_is_not_a_mapping_is_named_by_its_place(tmp_path: Path) -> None:
    path = write(tmp_path, SERVER % "" + "models:\n  - m\n  - {name: m, path: x, remote: true}\n")
    with pytest.raises(RemoteSpecError, match=r"field 'models.0': must be a mapping, not 'm'"):
        remote_spec(path, "m")


def test_the_worker_reads_the_file_within_the_gateways_bounds(tmp_path: Path) -> None:
    path = write(tmp_path, "models:\n  - name: m\n    path: x\n    remote: true\n    remote: false\n")
    with pytest.raises(RemoteSpecError, match=r"'remote' is given twice \(lines 4 and 5\)"):
        remote_spec(path, "m")
    with pytest.raises(RegistrationConfigError, match=r"'remote' is given twice"):
        etcd_target(path)
    laughs = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + n)}: &{chr(98 + n)} [{', '.join([f'*{chr(97 + n)}'] * 10)}]\n" for n in range(6)
    )
    path = write(tmp_path, laughs + ENTRY % "")
    with pytest.raises(RemoteSpecError, match=r"more than 100000 values"):
        remote_spec(path, "m")
    path.write_bytes(b"models: [\xff]\n")
    with pytest.raises(RemoteSpecError, match=r"not UTF-8 text"):
        remote_spec(path, "m")


def test_a_valid_entry_gives_the_spec_the_gateway_would(tmp_path: Path) -> None:
    extra = ", env: {A: b}, limits: {max_concurrent_jobs: 3, worker_queued_jobs: 2, request_timeout_s: 5}"
    timing = "heartbeat_interval_s: 0.5, heartbeat_timeout_s: 4, "
    path = write(tmp_path, ENTRY.replace("{", "{" + timing, 1) % extra)
    spec = remote_spec(path, "m")
    assert (spec.max_jobs, spec.max_queue, spec.env) == (3, 2, {"A": "b"})
    assert (spec.heartbeat_interval_s, spec.heartbeat_timeout_s) == (0.5, 4.0)
    assert spec.path == str((tmp_path / "x").resolve())
