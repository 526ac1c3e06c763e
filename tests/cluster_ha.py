"""Several gateways behind HAProxy, with etcd, Redis and listening workers on hosts of their own.

Runs in the pytest process. Owns `HaCluster`: on a LAN of network namespaces (tests.cluster_ha_net)
three gateways (gw-1..gw-3, each on its own host, port 8000), two hosts with one listening worker
each (`model-worker --listen`, transformers on the demo model: two replicas of model `ha`), a third
worker host whose worker (the spare, replica 2) only the cases that need one start, with etcd a
fourth worker host whose worker serves a `load: on_demand` model (`ha-lazy`, slow to load: the fault
engine's FAULT_LOAD_DELAY_S) and stands by until the leader loads it, Redis on a host of its own
(rate limits shared by the gateways), and HAProxy in the test's own namespace, round
robin over the gateways (tests.haproxy_server). How the gateways find the workers is a parameter,
`membership`: `EtcdMembership` runs etcd on a host of its own (the workers register themselves
there, the gateways watch it and elect a leader); `StaticMembership` lists the workers in every
gateway's registry and runs nothing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from tests.cluster_ha_net import Host, Lan
from tests.etcd_server import EtcdServer
from tests.haproxy_server import HAProxy
from tests.harness import REPO_ROOT, GatewayProcess, wait_until
from tests.integration.conftest import demo_entry, write_registry
from tests.redis_server import RedisServer

MODEL = "ha"
# Loaded on demand by the leading gateway (etcd only): its load takes FAULT_LOAD_DELAY_S more, so a
# case can kill the leader while the load is in flight.
LAZY_MODEL = "ha-lazy"
TEST_ENGINES = {"GATEWAY_ALLOW_TEST_ENGINES": "1"}
GATEWAYS = ("gw-1", "gw-2", "gw-3")
GATEWAY_PORT, WORKER_PORT, REDIS_PORT, ETCD_PORT, ETCD_PEER_PORT = 8000, 5601, 6379, 2379, 2380
# The leader's lease: short, so that a dead leader is replaced in seconds. The workers' lease is long:
# nothing here waits for one to expire (a stopped worker revokes it); on 2 busy cores a stall of 3 s
# let a 3 s lease expire under a live worker; and it outlasts a host cut off (about 10 s), because a
# worker that leaves and joins again within a moment can be lost for good by a gateway (seen here:
# the gateway reconnects under the same routing id, the worker fails to route to it and forgets it).
LEADER_TTL_S, WORKER_TTL_S = 3, 30
HEARTBEAT_TIMEOUT_S = 2.0
# Each worker runs 2 jobs and holds 2 more waiting (not yet started): 8 slots for the 6 clients of
# the load, so a steady load never meets a full worker, and each worker usually has a job waiting.
MAX_JOBS, WORKER_QUEUE = 2, 2
ADMIN_KEY = "ops-0123456789abcdefghij"
LOAD_KEY = "load-0123456789abcdefghi"  # rate-limited far above the load: Redis is asked each time
# 2 requests a minute each: one for each phase of the Redis case (Redis up, down, back).
LIMITED_KEYS = {phase: f"{phase}-0123456789abcdefghij" for phase in ("before", "during", "after")}


@dataclass(frozen=True)
class Worker:
    worker_id: str
    replica: int
    host: Host
    key_name: str  # its key pair in the keys folder

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host.ip}:{WORKER_PORT}"


class Membership(Protocol):
    """How gateways find workers: what it runs, and what the registry and the workers are told."""

    name: str

    def start(self, lan: Lan, root: Path) -> None: ...
    def heal(self) -> None: ...
    def stop(self) -> None: ...
    def cluster_section(self, workers: list[Worker], keys: Path) -> dict[str, Any]: ...
    def worker_args(self, worker: Worker) -> list[str]: ...


class StaticMembership:
    """The workers listed in every gateway's registry (`backend: static`): nothing to run."""

    name = "static"

    def start(self, lan: Lan, root: Path) -> None:
        pass

    def heal(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def cluster_section(self, workers: list[Worker], keys: Path) -> dict[str, Any]:
        listed = [{"worker_id": w.worker_id, "model": MODEL, "endpoint": w.endpoint, "replica": w.replica,
                   "public_key_file": str(keys / f"{w.key_name}.key")} for w in workers]  # fmt: skip
        return {"backend": "static", "workers": listed}

    def worker_args(self, worker: Worker) -> list[str]:
        return []


class NetnsEtcd(EtcdServer):
    """etcd on a host of the LAN (its client port 2379 there); killed and started on the same data."""

    def __init__(self, folder: Path, host: Host) -> None:
        folder.mkdir(exist_ok=True)
        super().__init__(folder)
        self.host = host
        self.name, self.ip = "ha", host.ip
        self.client_port, self.peer_port = ETCD_PORT, ETCD_PEER_PORT

    def command(self, arguments: list[str]) -> list[str]:
        return self.host.command(*arguments)


class EtcdMembership:
    """`backend: etcd`: etcd on a host of its own; each worker registers itself there (its registry
    copy says where), every gateway watches it and campaigns for the leader's lease."""

    name = "etcd"

    def __init__(self) -> None:
        self.etcd: NetnsEtcd | None = None

    def start(self, lan: Lan, root: Path) -> None:
        self.etcd = NetnsEtcd(root / "etcd", lan.add_host("etcd", 40))
        self.etcd.start()

    def heal(self) -> None:
        if self.etcd is not None and self.etcd.process is None:
            self.etcd.start()

    def stop(self) -> None:
        if self.etcd is not None:
            self.etcd.kill()

    def cluster_section(self, workers: list[Worker], keys: Path) -> dict[str, Any]:
        assert self.etcd is not None
        etcd = {"endpoints": [self.etcd.endpoint], "prefix": "/ha/", "worker_ttl_s": WORKER_TTL_S,
                "leader_ttl_s": LEADER_TTL_S, "request_timeout_s": 0.5, "retry_interval_s": 0.2}  # fmt: skip
        return {"backend": "etcd", "etcd": etcd}

    def worker_args(self, worker: Worker) -> list[str]:
        return ["--replica", str(worker.replica)]  # it advertises its --listen address


class ClusterGateway(GatewayProcess):
    """A gateway on a host of the LAN (port 8000 there); the admin API with the admin key."""

    def __init__(self, config_path: Path, host: Host, log_path: Path) -> None:
        super().__init__(config_path, wait_ready=False, log_path=log_path, env=TEST_ENGINES)
        self.host = host
        self.port = GATEWAY_PORT
        self.url = f"http://{host.ip}:{GATEWAY_PORT}"

    def __enter__(self) -> ClusterGateway:
        self._log = open(self.log_path, "ab")
        cmd = self.host.command(sys.executable, "-m", "gateway", "serve", "--config", str(self.config_path),
                                "--host", self.host.ip, "--port", str(self.port))  # fmt: skip
        self.process = subprocess.Popen(
            cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
        return self

    def admin_get(self, path: str) -> Any:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        reply = httpx.get(self.url + path, headers=headers, timeout=5)
        reply.raise_for_status()
        return reply.json()

    def workers(self) -> list[dict[str, Any]]:
        return self.admin_get("/admin/workers")["workers"]  # type: ignore[no-any-return]

    def leads(self) -> bool:
        """Whether this gateway holds the cluster's leadership now (GET /admin/cluster)."""
        return bool(self.admin_get("/admin/cluster")["leader_election"]["leader"])

    def retire(self, worker_id: str, grace_s: float) -> httpx.Response:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        return httpx.post(self.url + f"/admin/workers/{worker_id}/retire", params={"grace_s": grace_s},
                          headers=headers, timeout=30)  # fmt: skip

    def worker_state(self, worker_id: str) -> str | None:
        found = [w["state"] for w in self.workers() if w["id"] == worker_id]
        return str(found[0]) if found else None


class NetnsRedis(RedisServer):
    """redis-server on a host of the LAN."""

    def __init__(self, folder: Path, host: Host) -> None:
        super().__init__(folder)
        self.host = host
        self.port = REDIS_PORT

    @property
    def url(self) -> str:
        return f"redis://{self.host.ip}:{self.port}/0"

    def start(self) -> None:
        # Protected mode admits loopback only; this Redis serves the other hosts of a test LAN.
        args = self.host.command(self.binary, "--port", str(self.port), "--bind", self.host.ip,
                                 "--protected-mode", "no", "--save", "", "--appendonly", "no",
                                 "--dir", str(self.folder))  # fmt: skip
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(self._answers, "redis-server answers PING")

    def _answers(self) -> bool:
        import redis

        try:
            return bool(redis.Redis(host=self.host.ip, port=self.port, socket_timeout=0.5).ping())
        except redis.exceptions.ConnectionError:
            return False


def _keys_file(path: Path) -> None:
    entries = [f"  - {{name: ops, key: {ADMIN_KEY}, admin: true, models: ['*']}}",
               f"  - {{name: load, key: {LOAD_KEY}, models: ['*'], rate_limit_rpm: 100000}}"]  # fmt: skip
    entries += [f"  - {{name: {phase}, key: {key}, models: ['*'], rate_limit_rpm: 2}}"
                for phase, key in LIMITED_KEYS.items()]  # fmt: skip
    path.write_text("keys:\n" + "\n".join(entries) + "\n")
    path.chmod(0o600)


class HaCluster:
    """Use as a context manager: everything started is stopped on exit, the network removed."""

    def __init__(self, root: Path, model_dir: Path, membership: Membership) -> None:
        self.root = root
        self.model_dir = model_dir
        self.membership = membership
        self.keys = root / "keys"
        self.gateways: dict[str, ClusterGateway] = {}
        self.worker_processes: dict[str, subprocess.Popen[bytes]] = {}
        self._stack = ExitStack()

    # -- start and stop ------------------------------------------------------------------------

    def __enter__(self) -> HaCluster:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        self.lan = self._stack.enter_context(Lan())
        self.gateway_hosts = {name: self.lan.add_host(name, 11 + n) for n, name in enumerate(GATEWAYS)}
        # The third is the spare: it runs only once a case starts it, and wait_whole ignores it.
        *self.workers, self.spare = [
            Worker(f"{MODEL}@host-{x}", n, self.lan.add_host(f"host-{x}", 21 + n), f"worker-{x}")
            for n, x in enumerate("abc")
        ]
        self.lazy = Worker(f"{LAZY_MODEL}@host-d", 0, self.lan.add_host("host-d", 24), "worker-d")
        self.redis = NetnsRedis(self.root, self.lan.add_host("redis", 30))
        subprocess.run(
            [sys.executable, "-m", "gateway", "keys", str(self.keys), "--name", "gateway",
             *[arg for w in [*self.workers, self.spare, self.lazy] for arg in ("--name", w.key_name)]],
            check=True, cwd=REPO_ROOT, capture_output=True,
        )  # fmt: skip
        _keys_file(self.root / "keys.yaml")
        self.membership.start(self.lan, self.root)
        self._stack.callback(self.membership.stop)
        self._stack.callback(self.redis.stop)
        self.redis.start()
        self.configs = {name: self._registry(name) for name in GATEWAYS}
        for worker in self.workers:
            self.start_worker(worker)
        for name in GATEWAYS:
            self.start_gateway(name)
        self.haproxy = HAProxy(
            self.root, {n: f"{h.ip}:{GATEWAY_PORT}" for n, h in self.gateway_hosts.items()}
        )
        self._stack.callback(self.haproxy.stop)
        self.haproxy.start()
        self.wait_whole()

    def _registry(self, gateway: str) -> Path:
        limits = {
            "max_concurrent_jobs": MAX_JOBS,
            "worker_queued_jobs": WORKER_QUEUE,
            "max_queued_requests": 32,
        }
        cluster = {**self.membership.cluster_section(self.workers, self.keys), "identity": gateway,
                   "secret_key_file": str(self.keys / "gateway.key_secret")}  # fmt: skip
        models = [demo_entry(MODEL, self.model_dir, remote=True, limits=limits)]
        if self.membership.name == "etcd":  # only the etcd leader loads on demand in cluster mode
            models.append(demo_entry(LAZY_MODEL, self.model_dir, remote=True, load="on_demand",
                                     engine="test:tests.fault_engines.FaultyEngine",
                                     env={"FAULT_LOAD_DELAY_S": "3"}, limits=limits))  # fmt: skip
        return write_registry(
            self.root / f"{gateway}.yaml",
            models,
            heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
            api_keys_file="keys.yaml",
            redis_url=self.redis.url,
            cluster=cluster,
        )

    def start_worker(self, worker: Worker) -> None:
        model = worker.worker_id.split("@")[0]
        cmd = worker.host.command(
            sys.executable, "-m", "model_worker", "--listen", worker.endpoint,
            "--config", str(self.configs[GATEWAYS[0]]), "--model", model, "--worker-id", worker.worker_id,
            "--curve-secret-key", str(self.keys / f"{worker.key_name}.key_secret"),
            "--gateway-public-key", str(self.keys / "gateway.key"), "--shutdown-grace-s", "1",
            *self.membership.worker_args(worker),
        )  # fmt: skip
        with open(self.worker_log_path(worker), "ab") as log:  # the child keeps its own copy of the fd
            process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                       env={**os.environ, **TEST_ENGINES})  # fmt: skip
        self.worker_processes[worker.worker_id] = process

        def stop() -> None:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

        self._stack.callback(stop)

    def start_gateway(self, name: str) -> ClusterGateway:
        """gw-N on its host; a gateway of that name killed before is replaced (same address)."""
        gateway = ClusterGateway(self.configs[name], self.gateway_hosts[name], self.root / f"{name}.log")
        self.gateways[name] = self._stack.enter_context(gateway)
        return gateway

    def kill_gateway(self, name: str) -> None:
        process = self.gateways[name].process
        assert process is not None
        process.kill()
        process.wait(10)

    def heal(self) -> None:
        """Whatever a case broke (and did not mend, because it failed) is whole again."""
        self.membership.heal()
        for name, gateway in list(self.gateways.items()):
            if gateway.process is None or gateway.process.poll() is not None:
                self.start_gateway(name)
        if self.redis.process is None:
            self.redis.start()
        for worker in self.workers:
            worker.host.mend()
        self.wait_whole()

    def running(self, worker: Worker) -> bool:
        process = self.worker_processes.get(worker.worker_id)
        return process is not None and process.poll() is None

    def wait_ready_everywhere(self, worker: Worker, timeout: float = 180, state: str = "ready") -> None:
        """Every gateway alive sees `worker` ready (a fresh worker loads its model first), or in
        `state` (`unloaded`: a standby worker)."""
        for gateway in self.gateways.values():
            if gateway.process is None or gateway.process.poll() is not None:
                continue  # a gateway a case killed

            def context(g: ClusterGateway = gateway) -> str:
                return self.worker_log(worker)[-2000:] + "\n--- gateway:\n" + g.events()

            wait_until(lambda g=gateway: g.worker_state(worker.worker_id) == state,
                       f"{worker.worker_id} {state} in {gateway.url}", timeout, context=context)  # fmt: skip

    def wait_whole(self) -> None:
        """Every gateway ready, seeing every worker ready, and UP in HAProxy."""
        for gateway in self.gateways.values():
            gateway.wait_until_ready(180)
            for worker in self.workers:
                wait_until(lambda g=gateway, w=worker: g.worker_state(w.worker_id) == "ready",
                           f"{worker.worker_id} ready in {gateway.url}", context=gateway.events)  # fmt: skip
        self.haproxy.wait_states({name: "UP" for name in GATEWAYS}, "every gateway UP in HAProxy")

    # -- what happened -------------------------------------------------------------------------

    def worker_log_path(self, worker: Worker) -> Path:
        return self.root / f"{worker.host.name}.log"

    def worker_log(self, worker: Worker) -> str:
        return self.worker_log_path(worker).read_text(errors="replace")

    def gateway_log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def gone_lines(self, worker: Worker, gateway: str | None = None) -> list[tuple[int, str]]:
        """(jobs cancelled, line) for each time `worker` logged a gateway (`gateway`, or any) gone."""
        pattern = re.compile(r"gateway ([^/\s]+)/\S* is gone .*cancelling its (\d+) job")
        return [(int(m.group(2)), line) for line in self.worker_log(worker).splitlines()
                if (m := pattern.search(line)) and gateway in (None, m.group(1))]  # fmt: skip

    def request_ids_logged(self, text: str) -> set[str]:
        """The request ids of the gateways' log lines that contain `text`."""
        found: set[str] = set()
        for name in GATEWAYS:
            for line in self.gateway_log(name).splitlines():
                if text in line and (m := re.search(r"request_id=([A-Za-z0-9._-]+)", line)):
                    found.add(m.group(1))
        return found


def direct_completion(gateway: ClusterGateway, api_key: str, model: str = MODEL, timeout: float = 30) -> int:
    """One short completion sent to this gateway itself (not through HAProxy): its status."""
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    headers = {"Authorization": f"Bearer {api_key}"}
    return httpx.post(
        gateway.url + "/v1/completions", json=body, headers=headers, timeout=timeout
    ).status_code
