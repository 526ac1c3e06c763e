"""Deployment files: the Kubernetes manifests, compose.yaml and the systemd unit, checked offline.

Runs in the pytest process; needs no network and no cluster. Every manifest under deploy/kubernetes
is validated against the Kubernetes API's JSON schemas in strict mode (unknown fields are errors)
with `kubernetes-validate`, which ships the schemas of every Kubernetes release it supports inside
the package. Beyond the schemas, the manifests must agree with each other and with the gateway:
every Secret, ConfigMap and claim a pod uses exists (kustomize's secretGenerator counts) and holds
the keys the pod reads; Services select pods that have the ports they target; each worker
StatefulSet serves a `remote: true` model of the registry ConfigMap and reaches the gateway's worker
port; the probes behave as their comments say (run here against a stub server and real processes).
Where `kubectl` is installed, `kubectl kustomize` renders the whole set from the files that
make-secrets.sh writes, and the rendered objects go through the same checks.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import wait_until

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[test]'")

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOY = REPO_ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
CLUSTER = DEPLOY / "kubernetes-cluster"  # cluster mode: an overlay of K8S
NAMESPACE = "llm-gateway"
# The oldest Kubernetes release the manifests claim, and the newest the validator knows.
MIN_K8S_VERSION = "1.29"
K8S_VERSIONS = (MIN_K8S_VERSION, kubernetes_validate.latest_version())
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
# Volume types the "restricted" Pod Security Standard allows (the namespace enforces it).
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret"
}  # fmt: skip


# ---- loading --------------------------------------------------------------------------------------


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def load_docs(paths: list[Path]) -> list[dict[str, Any]]:
    docs = []
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append(doc)
    return docs


def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())  # type: ignore[no-any-return]


def generator_file_keys(entry: dict[str, Any]) -> dict[str, str]:
    """secretGenerator `files`: data key -> source path (`key=path`, or the path's file name)."""
    keys = {}
    for item in entry.get("files", []):
        key, _, source = item.rpartition("=") if "=" in item else (Path(item).name, "", item)
        keys[key] = source
    return keys


def generated_secrets() -> list[dict[str, Any]]:
    """The Secrets kustomize makes from secretGenerator, with stand-in data, under their base names."""
    namespace = kustomization().get("namespace", NAMESPACE)
    secrets = []
    for entry in kustomization().get("secretGenerator", []):
        data = {key: base64.b64encode(b"stand-in").decode() for key in generator_file_keys(entry)}
        metadata = {"name": entry["name"], "namespace": namespace}
        secrets.append(
            {"apiVersion": "v1", "kind": "Secret", "metadata": metadata, "type": "Opaque", "data": data}
        )
    return secrets


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    """The manifests as written, plus the Secrets the kustomization generates."""
    return load_docs(manifest_files()) + generated_secrets()


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name!r}, found {len(found)}"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def pod_labels(workload: dict[str, Any]) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]  # type: ignore[no-any-return]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def component(docs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [
        w for w in docs if w["kind"] in WORKLOADS and pod_labels(w).get("app.kubernetes.io/component") == name
    ]


def gateway_deployment(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (gateway,) = component(docs, "gateway")
    return gateway


def registry_raw(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (config,) = [c for c in of_kind(docs, "ConfigMap") if "models.yaml" in c.get("data", {})]
    return yaml.safe_load(config["data"]["models.yaml"])  # type: ignore[no-any-return]


def flags(args: list[str]) -> dict[str, str]:
    """`--flag value` pairs of a container's args (every flag these manifests use takes a value)."""
    assert len(args) % 2 == 0 and all(a.startswith("--") for a in args[::2]), args
    return dict(zip(args[::2], args[1::2], strict=True))


def mounted_file(spec: dict[str, Any], container: dict[str, Any], path: str) -> tuple[dict[str, Any], str]:
    """(volume, key) that provide the file at `path` in this container: a Secret or ConfigMap key."""
    folder, _, name = path.rpartition("/")
    mounts = [m for m in container.get("volumeMounts", []) if m["mountPath"] == folder]
    assert mounts, f"{container['name']}: nothing is mounted at {folder} (for {path})"
    volume = next(v for v in spec["volumes"] if v["name"] == mounts[0]["name"])
    return volume, name


def source_keys(docs: list[dict[str, Any]], volume: dict[str, Any]) -> set[str]:
    """The file names a Secret or ConfigMap volume shows (its items, or every key of the object)."""
    if "secret" in volume:
        source, kind, name = volume["secret"], "Secret", volume["secret"]["secretName"]
    elif "configMap" in volume:
        source, kind, name = volume["configMap"], "ConfigMap", volume["configMap"]["name"]
    else:
        raise AssertionError(f"volume {volume['name']} is neither a Secret nor a ConfigMap")
    obj = named(docs, kind, name)
    keys = set(obj.get("data", {})) | set(obj.get("stringData", {}))
    if "items" in source:
        return {item["path"] for item in source["items"] if item["key"] in keys}
    return keys


# ---- schemas --------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_matches_the_kubernetes_schema(docs: list[dict[str, Any]], version: str) -> None:
    assert len(manifest_files()) >= 6
    failures = []
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            failures.append(f"{doc['kind']}/{doc['metadata']['name']}: {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:  # an unknown kind is a failure, not a skip
            failures.append(exc.message)
    assert not failures, "\n".join(failures)


def test_the_validator_rejects_broken_manifests_and_needs_no_network(
    docs: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_network(*args: object, **kwargs: object) -> None:
        raise OSError("the network is off in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    broken = json.loads(json.dumps(gateway_deployment(docs)))
    container = pod_spec(broken)["containers"][0]
    container["resource"] = container.pop("resources")  # a typo: unknown field
    with pytest.raises(kubernetes_validate.ValidationError, match="'resource' was unexpected"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)
    container["resources"] = container.pop("resource")
    container["ports"][0]["containerPort"] = "8000"  # a string where the API wants an integer
    with pytest.raises(kubernetes_validate.ValidationError, match="is not of type 'integer'"):
        kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest_and_keeps_secrets_out_of_git() -> None:
    listed = kustomization()["resources"]
    assert sorted(listed) == [p.name for p in manifest_files()]
    assert kustomization()["namespace"] == NAMESPACE
    for entry in kustomization()["secretGenerator"]:
        for source in generator_file_keys(entry).values():
            assert source.startswith("secrets/"), source
    assert "secrets/" in (K8S / ".gitignore").read_text().split()
    script = K8S / "make-secrets.sh"
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)


# ---- cross-references -----------------------------------------------------------------------------


def check_references(docs: list[dict[str, Any]]) -> None:
    """Everything a pod mounts or reads exists, with the keys it reads; Services and selectors meet pods."""
    namespaces = {d["metadata"]["name"] for d in of_kind(docs, "Namespace")}
    assert namespaces == {NAMESPACE}
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]
    workloads = [d for d in docs if d["kind"] in WORKLOADS]
    assert workloads
    for workload in workloads:
        spec, name = pod_spec(workload), workload["metadata"]["name"]
        assert selects(workload["spec"]["selector"]["matchLabels"], pod_labels(workload)), name
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for volume in volumes.values():
            kind = next(k for k in volume if k != "name")
            assert kind in RESTRICTED_VOLUMES, f"{name}: volume type {kind} breaks the restricted profile"
            if kind in ("secret", "configMap"):
                keys = source_keys(docs, volume)
                wanted = {item["path"] for item in volume[kind].get("items", [])}
                assert keys and wanted <= keys, f"{name}: volume {volume['name']} lacks {wanted - keys}"
            if kind == "persistentVolumeClaim":
                named(docs, "PersistentVolumeClaim", volume[kind]["claimName"])
        claimed = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        for container in spec["containers"]:
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes.keys() | claimed, (
                    f"{name}/{container['name']}: no volume {mount['name']}"
                )
            for env in container.get("env", []):
                ref = env.get("valueFrom", {})
                for kind, field in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                    if field in ref:
                        obj = named(docs, kind, ref[field]["name"])
                        keys = set(obj.get("data", {})) | set(obj.get("stringData", {}))
                        assert ref[field]["key"] in keys, (
                            f"{name}: {kind} {obj['metadata']['name']} has no key"
                        )
            for source in container.get("envFrom", []):
                for kind, field in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                    if field in source:
                        named(docs, kind, source[field]["name"])
    for service in of_kind(docs, "Service"):
        pods = [w for w in workloads if selects(service["spec"]["selector"], pod_labels(w))]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"].get("ports", []):
            for pod in pods:
                container_ports = [p for c in pod_spec(pod)["containers"] for p in c.get("ports", [])]
                target = port.get("targetPort", port["port"])
                match = [p for p in container_ports if target in (p.get("name"), p["containerPort"])]
                assert match, (
                    f"Service {service['metadata']['name']}: {pod['metadata']['name']} has no {target}"
                )
                assert match[0]["containerPort"] == port["port"], "Service port and container port differ"
    for statefulset in of_kind(docs, "StatefulSet"):
        service = named(docs, "Service", statefulset["spec"]["serviceName"])
        assert service["spec"].get("clusterIP") == "None", "a StatefulSet's service must be headless"
        assert selects(service["spec"]["selector"], pod_labels(statefulset))
    for budget in of_kind(docs, "PodDisruptionBudget"):
        assert any(selects(budget["spec"]["selector"]["matchLabels"], pod_labels(w)) for w in workloads)
    for policy in of_kind(docs, "NetworkPolicy"):
        assert any(selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(w)) for w in workloads)
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                assert any(selects(peer["podSelector"]["matchLabels"], pod_labels(w)) for w in workloads)


def test_everything_a_pod_uses_exists(docs: list[dict[str, Any]]) -> None:
    check_references(docs)


def test_each_worker_statefulset_serves_a_remote_model_and_reaches_the_gateway(
    docs: list[dict[str, Any]],
) -> None:
    registry = registry_raw(docs)
    remote = {m["name"] for m in registry["models"] if m.get("remote")}
    bind_port = int(registry["server"]["remote_workers"]["bind"].rsplit(":", 1)[1])
    gateway = gateway_deployment(docs)
    workers = component(docs, "worker")
    assert workers and all(w["kind"] == "StatefulSet" for w in workers)
    served = []
    for worker in workers:
        spec = pod_spec(worker)
        (container,) = spec["containers"]
        assert container["command"] == ["model-worker"]
        args = flags(container["args"])
        served.append(args["--model"])
        assert args["--model"] in remote, f"{args['--model']} is not a remote: true model of the ConfigMap"
        assert args["--worker-id"] == f"{args['--model']}@$(POD_NAME)"
        (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
        assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        for resources in (container["resources"]["limits"], container["resources"].get("requests", {})):
            assert resources.get("nvidia.com/gpu", 1) == 1
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
        # --connect names a Service that selects the gateway and forwards to its worker port,
        # whatever the gateway's readiness says.
        host, port = re.fullmatch(r"tcp://([a-z0-9-]+):(\d+)", args["--connect"]).groups()  # type: ignore[union-attr]
        service = named(docs, "Service", host)
        assert selects(service["spec"]["selector"], pod_labels(gateway))
        assert service["spec"].get("publishNotReadyAddresses") is True
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        (gateway_port,) = [
            p for p in pod_spec(gateway)["containers"][0]["ports"] if p["name"] == service_port["targetPort"]
        ]
        assert gateway_port["containerPort"] == bind_port
        # The files the flags name are where the pod mounts them.
        volume, key = mounted_file(spec, container, args["--config"])
        assert volume["configMap"]["name"] == "llm-gateway-config" and key in source_keys(docs, volume)
        for flag in ("--curve-secret-key", "--gateway-public-key"):
            volume, key = mounted_file(spec, container, args[flag])
            assert key in source_keys(docs, volume), f"{flag}: {args[flag]} is not in its Secret"
        # A worker pod holds its own secret key and the gateway's public key, never the gateway's secret.
        assert not any(k.endswith(".key_secret") and "gateway" in k for k in source_keys(docs, volume))
    assert sorted(served) == sorted(remote), "every remote model needs workers, and only remote models"
    assert len(served) >= 2


def test_each_worker_keeps_its_compiled_gpu_kernels_on_a_claim_of_its_own(docs: list[dict[str, Any]]) -> None:
    """Triton's cache (exllamav3's kernels) is on the replica's own PersistentVolumeClaim, not in an
    emptyDir that a replaced pod loses: a restarted worker loads its kernels instead of compiling."""
    workers = component(docs, "worker")
    assert workers
    for worker in workers:
        claims = {t["metadata"]["name"]: t for t in worker["spec"].get("volumeClaimTemplates", [])}
        container = pod_spec(worker)["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        cache = env.get("TRITON_CACHE_DIR")
        assert cache, f"{worker['metadata']['name']}: no TRITON_CACHE_DIR"
        # The mount the directory is on: the deepest whose path holds it.
        mounts = [m for m in container["volumeMounts"] if cache.startswith(m["mountPath"].rstrip("/") + "/")]
        assert mounts, f"{worker['metadata']['name']}: TRITON_CACHE_DIR is on no mount"
        mount = max(mounts, key=lambda m: len(m["mountPath"]))
        assert mount["name"] in claims and not mount.get("readOnly"), worker["metadata"]["name"]
        assert claims[mount["name"]]["spec"]["accessModes"] == ["ReadWriteOnce"]


def test_gateway_mounts_what_its_registry_names_and_probes_its_health_endpoints(
    docs: list[dict[str, Any]],
) -> None:
    registry = registry_raw(docs)
    gateway = gateway_deployment(docs)
    spec = pod_spec(gateway)
    assert gateway["spec"]["replicas"] == 1 and gateway["spec"]["strategy"]["type"] == "Recreate"
    (container,) = spec["containers"]
    assert container["args"][0] == "serve"
    args = flags(container["args"][1:])
    volume, key = mounted_file(spec, container, args["--config"])
    assert "configMap" in volume and key == "models.yaml"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == registry["server"]["port"] == int(args["--port"])
    assert args["--host"] == registry["server"]["host"] == "0.0.0.0"
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    remote = registry["server"]["remote_workers"]
    for path in (registry["server"]["api_keys_file"], remote["secret_key_file"]):
        volume, key = mounted_file(spec, container, path)
        assert key in source_keys(docs, volume), f"{path} is not in the Secret mounted there"
    # The authorized folder holds public keys only.
    authorized = [m for m in container["volumeMounts"] if m["mountPath"] == remote["authorized_keys_dir"]]
    assert authorized, f"nothing is mounted at authorized_keys_dir {remote['authorized_keys_dir']}"
    volume = next(v for v in spec["volumes"] if v["name"] == authorized[0]["name"])
    keys = source_keys(docs, volume)
    assert keys and all(k.endswith(".key") for k in keys), keys
    # Probes need no key: liveness on /health/live, readiness on /health/ready under the registry's
    # `any` policy (the only gateway pod stays in the Service while any model can serve).
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health/live", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    assert registry["server"]["readiness"] == "any"
    assert all(e["name"] != "GATEWAY_PROBE_KEY" for e in container.get("env", []))
    assert args["--log-format"] == "json"
    # Shutdown: the grace period covers the preStop sleep plus the gateway's own drain.
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert spec["terminationGracePeriodSeconds"] > registry["server"]["shutdown_grace_s"] + sleep


def test_registry_configmap_is_a_valid_registry(docs: list[dict[str, Any]]) -> None:
    from gateway.config.models import ModelConfig
    from gateway.config.registry import parse_registry
    from gateway.config.server_config import ServerConfig

    if "remote" not in ModelConfig.model_fields or "remote_workers" not in ServerConfig.model_fields:
        pytest.skip("this checkout's registry has no remote workers yet")
    registry = parse_registry(registry_raw(docs), Path("/etc/llm-gateway/config/models.yaml"))
    assert all(m.remote for m in registry.models)


def test_pods_run_unprivileged_with_resources_and_grace(docs: list[dict[str, Any]]) -> None:
    shutdown_grace_s = registry_raw(docs)["server"]["shutdown_grace_s"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    image_uid = int(re.search(r"--uid (\d+)", dockerfile).group(1))  # type: ignore[union-attr]
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert re.search(r'ENTRYPOINT \["gateway"\]', dockerfile)
    assert re.search(r'^model-worker = "model_worker', pyproject, re.M), "worker pods run model-worker"
    for workload in (d for d in docs if d["kind"] in WORKLOADS):
        spec, name = pod_spec(workload), workload["metadata"]["name"]
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] == image_uid, name
        assert pod["seccompProfile"]["type"] == "RuntimeDefault", name
        assert spec["automountServiceAccountToken"] is False, name
        assert spec["terminationGracePeriodSeconds"] > shutdown_grace_s, name
        for container in spec["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            uses_gpu = "nvidia.com/gpu" in container["resources"].get("limits", {})
            # GPU containers keep a writable root: the NVIDIA container hooks write to it.
            assert security["readOnlyRootFilesystem"] is (not uses_gpu), name
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
            assert "memory" in container["resources"]["limits"], name
            assert container["image"].split(":")[0] == kustomization()["images"][0]["name"], name
            assert "livenessProbe" in container, name
    namespace = named(docs, "Namespace", NAMESPACE)
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# ---- the probes, run ------------------------------------------------------------------------------


def run_probe(script: str, env: dict[str, str] | None = None) -> int:
    return subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **(env or {})}, timeout=20, capture_output=True
    ).returncode


def test_worker_liveness_probe_fails_for_a_stopped_or_foreign_process(docs: list[dict[str, Any]]) -> None:
    (worker, *_) = component(docs, "worker")
    script = pod_spec(worker)["containers"][0]["livenessProbe"]["exec"]["command"][2]
    assert script.count("/proc/1/") == 2

    def probe(pid: int) -> int:
        return run_probe(script.replace("/proc/1/", f"/proc/{pid}/"))

    sleeper = "import time; time.sleep(60)"  # a process that only has to exist while probed
    fake_worker = subprocess.Popen([sys.executable, "-c", sleeper, "/opt/conda/bin/model-worker"])
    other = subprocess.Popen([sys.executable, "-c", sleeper, "something-else"])
    try:
        assert probe(fake_worker.pid) == 0
        assert probe(other.pid) == 1
        os.kill(fake_worker.pid, signal.SIGSTOP)
        wait_until(lambda: probe(fake_worker.pid) == 1, "the probe to fail for the stopped process")
    finally:
        for process in (fake_worker, other):
            process.kill()
            process.wait()


# ---- make-secrets.sh and kustomize ----------------------------------------------------------------


@pytest.fixture(scope="module")
def made_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes after make-secrets.sh (run twice), `gateway` being this checkout's CLI."""
    root = tmp_path_factory.mktemp("k8s")
    copy = root / "kubernetes"
    shutil.copytree(K8S, copy, ignore=shutil.ignore_patterns("secrets"))
    bin_dir = root / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "gateway"
    shim.write_text(f'#!/bin/sh\nPYTHONPATH="{REPO_ROOT}" exec "{sys.executable}" -m gateway "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(
        ["bash", str(copy / "make-secrets.sh")], env=env, check=True, capture_output=True, timeout=60
    )
    before = {p: p.read_bytes() for p in (copy / "secrets").rglob("*") if p.is_file()}
    subprocess.run(
        ["bash", str(copy / "make-secrets.sh")], env=env, check=True, capture_output=True, timeout=60
    )
    assert before == {p: p.read_bytes() for p in before}, "a second run must keep every key"
    return copy


def test_make_secrets_writes_every_generator_file_and_an_admin_key_the_keys_file_accepts(
    made_secrets: Path, docs: list[dict[str, Any]]
) -> None:
    import zmq.auth

    from gateway.config.api_keys import KeysFile

    secrets = made_secrets / "secrets"
    for entry in kustomization()["secretGenerator"]:
        for source in generator_file_keys(entry).values():
            path = made_secrets / source
            assert path.is_file(), source
            assert path.stat().st_mode & 0o077 == 0, f"{source} is readable by others"
    keys = KeysFile.model_validate(yaml.safe_load((secrets / "api-keys.yaml").read_text())).keys
    admin_key = secrets.joinpath("admin-key.txt").read_text().strip()
    assert len(admin_key) >= 32
    (entry,) = [k for k in keys if k.key_sha256 == hashlib.sha256(admin_key.encode()).hexdigest()]
    assert entry.admin
    for name in ("gateway", "worker"):  # CURVE key pairs in zmq.auth's format, as `gateway keys` writes
        public, secret = zmq.auth.load_certificate(str(secrets / "curve" / f"{name}.key_secret"))
        assert secret and zmq.auth.load_certificate(str(secrets / "curve" / f"{name}.key"))[0] == public


def test_kustomize_renders_a_valid_consistent_set(made_secrets: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the source manifests are checked without it")
    rendered = subprocess.run(
        [kubectl, "kustomize", str(made_secrets)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    docs = [d for d in yaml.safe_load_all(rendered) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)
    check_references(docs)
    # Hashed CURVE Secret names reached the pods; the API keys Secret kept its name (hot reload).
    curve = [d["metadata"]["name"] for d in of_kind(docs, "Secret") if "curve" in d["metadata"]["name"]]
    assert len(curve) == 3 and all(re.search(r"-[a-z0-9]{10}$", n) for n in curve), curve
    named(docs, "Secret", "llm-gateway-api-keys")
    sources = {d["kind"] for d in load_docs(manifest_files())} | {"Secret"}
    assert {d["kind"] for d in docs} == sources


# ---- cluster mode: deploy/kubernetes-cluster, an overlay of deploy/kubernetes ---------------------


def cluster_kustomization() -> dict[str, Any]:
    return yaml.safe_load((CLUSTER / "kustomization.yaml").read_text())  # type: ignore[no-any-return]


def render_overlay(base: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What `kubectl kustomize deploy/kubernetes-cluster` makes, without kustomize: the base, the
    overlay's own resources, then its JSON patches (RFC 6902, the only kind it uses)."""
    jsonpatch = pytest.importorskip("jsonpatch", reason="pip install -e '.[test]'")
    overlay = cluster_kustomization()
    assert overlay["resources"][0] == "../kubernetes" and overlay["namespace"] == NAMESPACE
    rendered = copy.deepcopy(base) + load_docs([CLUSTER / name for name in overlay["resources"][1:]])
    for entry in overlay["patches"]:
        target = entry["target"]
        (index,) = [
            i for i, d in enumerate(rendered)
            if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]
        ]  # fmt: skip
        rendered[index] = jsonpatch.apply_patch(rendered[index], yaml.safe_load(entry["patch"]))
    return rendered


@pytest.fixture(scope="module")
def cluster_docs(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return render_overlay(docs)


def cluster_settings(docs: list[dict[str, Any]]) -> Any:
    from gateway.cluster.settings import ClusterConfig

    config = ClusterConfig.model_validate(registry_raw(docs)["server"]["cluster"])
    assert config.backend == "kubernetes"
    return config.kubernetes_settings()


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_cluster_overlay_matches_the_schema_and_its_references_hold(
    cluster_docs: list[dict[str, Any]], version: str
) -> None:
    assert sorted(p.name for p in CLUSTER.glob("*.yaml") if p.name != "kustomization.yaml") == sorted(
        cluster_kustomization()["resources"][1:]
    )
    for doc in cluster_docs:
        kubernetes_validate.validate(doc, version, strict=True)
    check_references(cluster_docs)


def test_cluster_gateways_are_active_active_and_may_read_slices_and_hold_leases(
    cluster_docs: list[dict[str, Any]],
) -> None:
    gateway = gateway_deployment(cluster_docs)
    assert gateway["spec"]["replicas"] >= 2
    assert gateway["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}
    }  # fmt: skip
    spec = pod_spec(gateway)
    account = named(cluster_docs, "ServiceAccount", spec["serviceAccountName"])
    # The token is mounted in the gateway pods only (the account does not mount it by default).
    assert spec["automountServiceAccountToken"] is True and account["automountServiceAccountToken"] is False
    for worker in component(cluster_docs, "worker"):
        assert pod_spec(worker)["automountServiceAccountToken"] is False
        assert "serviceAccountName" not in pod_spec(worker)
    (binding,) = of_kind(cluster_docs, "RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    role = named(cluster_docs, "Role", binding["roleRef"]["name"])
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]
    }  # fmt: skip
    # Exactly what gateway/cluster/k8s_membership.py and k8s_leader.py call: no more.
    assert granted == {
        ("discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},
        ("coordination.k8s.io", "leases"): {"get", "create", "update", "delete"},
    }
    assert not of_kind(cluster_docs, "ClusterRole") and not of_kind(cluster_docs, "ClusterRoleBinding")
    budget = named(cluster_docs, "PodDisruptionBudget", "llm-gateway")
    assert selects(budget["spec"]["selector"]["matchLabels"], pod_labels(gateway))
    assert budget["spec"]["minAvailable"] < gateway["spec"]["replicas"]


def test_each_model_has_a_headless_service_whose_slices_the_gateways_read(
    cluster_docs: list[dict[str, Any]],
) -> None:
    from lightkube.resources.discovery_v1 import EndpointSlice

    from gateway.cluster.k8s_membership import slice_workers

    settings = cluster_settings(cluster_docs)
    assert settings.namespace == NAMESPACE and settings.api_server is None
    workers = component(cluster_docs, "worker")
    assert len(workers) >= 2
    for worker in workers:
        (container,) = pod_spec(worker)["containers"]
        args = flags(container["args"])
        model = args["--model"]
        service = named(cluster_docs, "Service", worker["spec"]["serviceName"])
        labels = service["metadata"]["labels"]
        assert service["spec"]["clusterIP"] == "None"
        assert all(labels.get(k) == v for k, v in settings.worker_selector.items())
        assert labels[settings.model_label] == model
        # The Service selects this model's pods and no other model's.
        chosen = [
            w["metadata"]["name"] for w in workers if selects(service["spec"]["selector"], pod_labels(w))
        ]
        assert chosen == [worker["metadata"]["name"]]
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == settings.port_name]
        (container_port,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
        assert container_port["containerPort"] == port["port"]
        host, listen_port = args["--listen"].removeprefix("tcp://").rsplit(":", 1)
        assert host == "0.0.0.0" and int(listen_port) == port["port"]
        assert container["readinessProbe"]["tcpSocket"]["port"] == port["targetPort"]
        # The slice the EndpointSlice controller makes for pod 0 gives the id the worker uses.
        pod = f"{worker['metadata']['name']}-0"
        endpoint_slice = EndpointSlice.from_dict({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
            "metadata": {"name": f"{service['metadata']['name']}-abcde", "labels": labels},
            "endpoints": [{"addresses": ["10.1.2.3"], "conditions": {"ready": True},
                           "targetRef": {"kind": "Pod", "name": pod}}],
            "ports": [{"name": port["name"], "port": port["port"], "protocol": "TCP"}],
        })  # fmt: skip
        (worker_id,) = slice_workers(endpoint_slice, settings)  # type: ignore[arg-type]
        assert worker_id == args["--worker-id"].replace("$(POD_NAME)", pod)
    # The governing Service of the parent set lacks the model label, so its slices are not read.
    assert settings.model_label not in named(cluster_docs, "Service", "llm-workers")["metadata"]["labels"]
    # Worker pods accept their port from gateway pods only.
    policy = named(cluster_docs, "NetworkPolicy", "llm-workers")
    ((rule),) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 5556, "protocol": "TCP"}]
    assert [p["podSelector"]["matchLabels"] for p in rule["from"]] == [
        {"app.kubernetes.io/name": "llm-gateway", "app.kubernetes.io/component": "gateway"}
    ]


def test_the_cluster_registry_is_the_parents_plus_its_cluster_section(
    docs: list[dict[str, Any]], cluster_docs: list[dict[str, Any]]
) -> None:
    cluster_registry = registry_raw(cluster_docs)
    cluster_registry["server"].pop("cluster")
    assert cluster_registry == registry_raw(docs)


def test_the_cluster_registry_and_worker_flags_are_accepted_once_integrated(
    cluster_docs: list[dict[str, Any]],
) -> None:
    from gateway.config.registry import parse_registry
    from gateway.config.server_config import ServerConfig

    if "cluster" not in ServerConfig.model_fields:
        pytest.skip("awaiting integration: the registry's server section has no `cluster` yet")
    parse_registry(registry_raw(cluster_docs), Path("/etc/llm-gateway/config/models.yaml"))
    if "--listen" not in (REPO_ROOT / "model_worker" / "main.py").read_text():
        pytest.skip("awaiting integration: model-worker has no --listen yet")


def test_kustomize_renders_the_cluster_overlay_as_the_test_does(
    made_secrets: Path, docs: list[dict[str, Any]]
) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the overlay is rendered by the tests alone")
    overlay = made_secrets.parent / "kubernetes-cluster"
    shutil.copytree(CLUSTER, overlay, dirs_exist_ok=True)
    rendered = subprocess.run(
        [kubectl, "kustomize", str(overlay)], check=True, capture_output=True, text=True, timeout=60
    ).stdout
    by_kustomize = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(rendered) if d}
    by_test = {(d["kind"], d["metadata"]["name"]): d for d in render_overlay(docs)}
    # Secrets differ in name (content hash) and data (real keys); everything else is identical.
    assert {k for k in by_kustomize if k[0] != "Secret"} == {k for k in by_test if k[0] != "Secret"}
    for key, doc in by_test.items():
        if key[0] not in ("Secret", "Deployment", "StatefulSet"):
            assert by_kustomize[key] == doc, key
    for key in [k for k in by_test if k[0] in ("Deployment", "StatefulSet")]:
        ours, theirs = (json.dumps(d[key], sort_keys=True) for d in (by_test, by_kustomize))
        assert re.sub(r"llm-gateway-curve-[a-z-]+?(-[a-z0-9]{10})?\"", 'S"', ours) == re.sub(
            r"llm-gateway-curve-[a-z-]+?(-[a-z0-9]{10})?\"", 'S"', theirs
        ), key


# ---- one host: compose and systemd (deeper checks in test_deploy_image.py) -------------------------


def test_compose_file_serves_what_the_repo_ships() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    gateway = compose["services"]["gateway"]
    assert compose["services"]["demo-models"]["build"]["dockerfile"] == "deploy/Dockerfile"
    # Every file it mounts by default is in the repository.
    (registry,) = [v for v in gateway["volumes"] if v.endswith(":/etc/llm-gateway/models.yaml:ro")]
    default = registry.split(":-", 1)[1].split("}", 1)[0]
    assert (DEPLOY / default).is_file(), default
