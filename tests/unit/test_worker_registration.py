"""A listening worker's etcd registration, without etcd: the record it writes is the one gateways
read, the registry's `server.cluster.etcd` as the worker reads it (errors name the file and the
field), and the address it advertises."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.cluster.etcd_membership import worker_key as gateway_worker_key
from gateway.cluster.membership import Capacity as GatewayCapacity
from gateway.cluster.membership import WorkerRecord
from model_worker.etcd_target import EtcdTarget, RegistrationConfigError, etcd_target
from model_worker.main import _advertised
from model_worker.registration import Capacity, Record, worker_key

KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"


def test_the_record_a_worker_writes_is_the_one_gateways_read() -> None:
    record = Record(
        worker_id="qwen@host-1", model="qwen", replica=1, endpoint="tcp://10.0.0.2:5556",
        public_key=KEY, capacity=Capacity(max_jobs=8, max_queue=4), protocol_version=5,
    )  # fmt: skip
    assert WorkerRecord.decode(record.encode()) == WorkerRecord(
        worker_id="qwen@host-1", model="qwen", replica=1, endpoint="tcp://10.0.0.2:5556",
        public_key=KEY, capacity=GatewayCapacity(max_jobs=8, max_queue=4), protocol_version=5,
    )  # fmt: skip
    bare = Record(worker_id="qwen@h", model="qwen", replica=0, endpoint="tcp://h:1")
    assert WorkerRecord.decode(bare.encode()).capacity is None
    assert worker_key("/p/", "qwen@h") == gateway_worker_key("/p/", "qwen@h")


def _registry(tmp_path: Path, server: object) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"server": server, "models": []}))
    return path


def test_the_worker_reads_etcd_from_the_registry_only_with_backend_etcd(tmp_path: Path) -> None:
    assert etcd_target(_registry(tmp_path, {})) is None
    static = {"cluster": {"backend": "static", "workers": []}}
    assert etcd_target(_registry(tmp_path, static)) is None
    etcd = {"cluster": {"backend": "etcd",
                        "etcd": {"endpoints": ["127.0.0.1:2379"], "prefix": "/x/", "worker_ttl_s": 4,
                                 "leader_ttl_s": 9, "request_timeout_s": 0.5}}}  # fmt: skip
    assert etcd_target(_registry(tmp_path, etcd)) == EtcdTarget(
        endpoints=["127.0.0.1:2379"], prefix="/x/", ttl_s=4, request_timeout_s=0.5
    )


def test_a_worker_without_etcd_never_imports_its_client(tmp_path: Path) -> None:
    """A listening worker of backend static runs where no etcd client is installed."""
    static = _registry(tmp_path, {"cluster": {"backend": "static", "workers": []}})
    probe = (
        "import argparse, sys\n"
        "from model_worker.main import _registration\n"
        f"assert _registration(argparse.Namespace(config={str(static)!r}), None, b'') is None\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('aetcd', 'grpc')))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("etcd", "field"),
    [
        (None, "server.cluster.etcd"),
        ({"endpoints": []}, "server.cluster.etcd.endpoints"),
        ({"endpoints": ["h:1"], "worker_ttl_s": "ten"}, "server.cluster.etcd.worker_ttl_s"),
        ({"endpoints": ["h:1"], "request_timeout_s": 0}, "server.cluster.etcd.request_timeout_s"),
    ],
)
def test_a_bad_etcd_section_names_the_file_and_the_field(tmp_path: Path, etcd: object, field: str) -> None:
    path = _registry(tmp_path, {"cluster": {"backend": "etcd", "etcd": etcd}})
    with pytest.raises(RegistrationConfigError) as caught:
        etcd_target(path)
    assert str(path) in str(caught.value) and repr(field) in str(caught.value)


def test_the_advertised_address() -> None:
    assert _advertised("tcp://10.0.0.5:5556", None) == "tcp://10.0.0.5:5556"
    assert _advertised("tcp://0.0.0.0:5556", "tcp://worker-1:5556") == "tcp://worker-1:5556"
    host = _advertised("tcp://*:5556", None)
    assert host.startswith("tcp://") and host.endswith(":5556") and "*" not in host
    with pytest.raises(SystemExit):
        _advertised("tcp://*:5556", "worker-1:5556")


def test_cluster_mode_refuses_a_model_the_gateway_would_spawn(tmp_path: Path) -> None:
    """Every gateway would spawn its own copy: in cluster mode each model is `remote: true`."""
    from gateway.config.registry import ConfigError, parse_registry

    source = tmp_path / "models.yaml"
    raw = {
        "server": {"cluster": {"backend": "etcd", "secret_key_file": "gw.key_secret",
                               "etcd": {"endpoints": ["127.0.0.1:2379"]}}},
        "models": [{"name": "served", "engine": "transformers", "path": "m", "remote": True},
                   {"name": "spawned", "engine": "transformers", "path": "m"}],
    }  # fmt: skip
    with pytest.raises(ConfigError) as caught:
        parse_registry(raw, source, check_engines=False)
    message = str(caught.value)
    assert str(source) in message and "'spawned'" in message and "'remote'" in message
    assert "'served'" not in message


@pytest.mark.parametrize(
    ("field", "value"), [("load", "on_demand"), ("idle_unload_s", 60), ("exclusive_group", "gpu0")]
)
@pytest.mark.parametrize("backend", ["static", "kubernetes"])
def test_only_the_etcd_leader_loads_and_unloads_listening_workers(
    tmp_path: Path, backend: str, field: str, value: object
) -> None:
    """Loads on demand, idle unloads and exclusive groups are decided by the etcd leader, which
    loads and unloads standby workers; another backend refuses them, naming file, model and field."""
    from gateway.config.registry import ConfigError, parse_registry

    source = tmp_path / "models.yaml"
    cluster: dict[str, object] = {"backend": backend, "secret_key_file": "gw.key_secret",
                                  "worker_public_key_file": "w.key"}  # fmt: skip
    if backend == "static":
        cluster["workers"] = [{"worker_id": "served@w1", "model": "served", "endpoint": "tcp://h:5601"}]
    entry = {"name": "served", "engine": "transformers", "path": "m", "remote": True}
    raw = {"server": {"cluster": cluster}, "models": [{**entry, field: value}]}
    with pytest.raises(ConfigError) as caught:
        parse_registry(raw, source, check_engines=False)
    message = str(caught.value)
    assert str(source) in message and "'served'" in message and f"field '{field}'" in message
    # On etcd the leader decides them: accepted, for a model loaded on demand.
    etcd = {"backend": "etcd", "secret_key_file": "gw.key_secret", "etcd": {"endpoints": ["h:2379"]}}
    on_demand = {**entry, "load": "on_demand", field: value}
    parse_registry({"server": {"cluster": etcd}, "models": [on_demand]}, source, False)
    if field != "load":  # a worker unloaded by the leader stands by: only a request loads it again
        with pytest.raises(ConfigError, match=r"model 'served', field 'load': .* must be `load: on_demand`"):
            parse_registry({"server": {"cluster": etcd}, "models": [{**entry, field: value}]}, source, False)
