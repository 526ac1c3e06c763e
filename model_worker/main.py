"""Worker process entry point (`model-worker`): pins GPUs, ties its life to the parent, serves.

Runs in the worker process. Owns process-level set-up that must happen before torch is imported:
`CUDA_VISIBLE_DEVICES`, the parent-death signal, logging. The gateway spawns it with
`python -m model_worker --connect ipc://... --worker-id ID --spec JSON`. A remote worker connects to
one gateway (`--connect tcp://...`); in cluster mode a worker is a service of its own that listens
(`--listen tcp://...`), serves every gateway whose key is authorized, and outlives any of them;
when its registry file says `server.cluster.backend: etcd` it also registers itself there
(model_worker.registration) until it stops, and a worker of a `load: on_demand` model then starts
in standby, without its model, which it loads when the leading gateway asks (model_worker.standby).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING

from wire import log_format
from wire.params import WorkerSpec

if TYPE_CHECKING:
    from model_worker.registration import RegistrationThread

logger = logging.getLogger("model_worker")

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM us when the gateway dies, so no orphan keeps a GPU."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        logger.warning("prctl(PR_SET_PDEATHSIG) unavailable; relying on the parent-pid watch")


# torch's intra-op threads (OpenMP, MKL) in a GPU worker: one unless the model's `env` says otherwise.
CPU_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _one_cpu_thread_for_gpu_workers() -> None:
    """A GPU worker's engine thread drives the generator from Python (exllamav3 runs one sampler
    launch per job beyond a batch of 8); torch's intra-op thread pool only spins against it. An H200
    worker as shipped ran 43 threads at 312% CPU and reached 0.5-0.6x the raw engine at 64 streams.
    Must run before torch is imported; a CPU worker keeps its engine's `threads` setting."""
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return
    for name in CPU_THREAD_VARIABLES:
        os.environ.setdefault(name, "1")


def _route_transformers_logs() -> None:
    """transformers writes through its own stderr handler, which would break JSON mode's one object
    per line; send its records through ours instead (only for workers that import it anyway)."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="model-worker", description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--connect", help="gateway endpoint, e.g. ipc:///run/gw/workers.sock")
    where.add_argument(
        "--listen",
        help="cluster mode: serve every authorized gateway that connects here, e.g. tcp://0.0.0.0:5556",
    )
    parser.add_argument("--worker-id", default=None, help="default for remote workers: MODEL@HOST-PID")
    parser.add_argument(
        "--replica", type=int, default=0, help="--listen: its replica index within the model (etcd record)"
    )
    parser.add_argument(
        "--advertise",
        default=None,
        help="--listen with server.cluster.backend etcd: the tcp://HOST:PORT gateways connect to "
        "(default: the --listen address, with a wildcard host replaced by this host's name)",
    )
    parser.add_argument("--spec", default=None, help="JSON worker spec written by the gateway")
    parser.add_argument("--config", default=None, help="remote workers: the registry file (models.yaml)")
    parser.add_argument("--model", default=None, help="remote workers: which model of --config to serve")
    parser.add_argument("--curve-secret-key", default=None, help="this worker's CURVE secret key file")
    parser.add_argument(
        "--gateway-public-key",
        action="append",
        default=None,
        help="the gateway's CURVE public key file; with --listen, once per gateway key allowed in",
    )
    parser.add_argument(
        "--gpus", default=None, help="comma-separated GPU indices (sets CUDA_VISIBLE_DEVICES)"
    )
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=None,
        help="on SIGTERM, let jobs finish this long (remote: 30)",
    )
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    parser.add_argument(
        "--log-format",
        choices=log_format.FORMATS,
        default=None,
        help="text or json (one object per line); default: $LOG_FORMAT (a gateway sets it), then text",
    )
    return parser.parse_args(argv)


def _spec(args: argparse.Namespace) -> WorkerSpec:
    """The spawning gateway's --spec, or, for a remote worker, the model's entry in --config."""
    if args.spec is not None:
        try:
            return WorkerSpec(**json.loads(args.spec))
        except (ValueError, TypeError) as exc:
            raise SystemExit(f"model-worker: invalid --spec: {exc}") from None
    if args.config is None or args.model is None:
        raise SystemExit("model-worker: give --spec (spawned by the gateway) or --config and --model")
    from model_worker.remote_spec import RemoteSpecError, remote_spec

    try:
        spec = remote_spec(args.config, args.model)
    except RemoteSpecError as exc:
        raise SystemExit(f"model-worker: {exc}") from None
    if args.worker_id is None:
        args.worker_id = f"{spec.name}@{socket.gethostname()}-{os.getpid()}"
    return spec


def _curve_keys(args: argparse.Namespace) -> tuple[bytes, bytes, list[bytes]] | None:
    """(own public key, own secret key, the gateway public keys), or None without CURVE."""
    if args.curve_secret_key is None and args.gateway_public_key is None:
        return None
    if args.curve_secret_key is None or args.gateway_public_key is None:
        raise SystemExit("model-worker: --curve-secret-key and --gateway-public-key go together")
    if args.connect is not None and len(args.gateway_public_key) != 1:
        raise SystemExit("model-worker: --connect talks to one gateway: give --gateway-public-key once")
    import zmq.auth

    def load(path: str, flag: str) -> tuple[bytes, bytes | None]:
        try:
            return zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"model-worker: {flag} {path}: not a CURVE key file: {exc}") from None

    public, secret = load(args.curve_secret_key, "--curve-secret-key")
    if secret is None:
        raise SystemExit(f"model-worker: {args.curve_secret_key} holds no secret key")
    return public, secret, [load(path, "--gateway-public-key")[0] for path in args.gateway_public_key]


def _advertised(listen: str, advertise: str | None) -> str:
    """Where gateways reach a listening worker: --advertise, else --listen with a real host name."""
    if advertise is not None:
        if not advertise.startswith("tcp://"):
            raise SystemExit("model-worker: --advertise must be tcp://HOST:PORT")
        return advertise
    host, _, port = listen[len("tcp://") :].rpartition(":")
    if host in ("*", "0.0.0.0", "[::]", "::", ""):
        host = socket.getfqdn()
    return f"tcp://{host}:{port}"


def _registration(args: argparse.Namespace, spec: WorkerSpec, public_key: bytes) -> RegistrationThread | None:
    """A started etcd registration when the registry says `server.cluster.backend: etcd`, else None."""
    from model_worker.etcd_target import RegistrationConfigError, etcd_target

    try:
        target = etcd_target(args.config)
    except RegistrationConfigError as exc:
        raise SystemExit(f"model-worker: {exc}") from None
    if target is None:
        return None
    # The etcd client only here: a worker of another backend needs none installed.
    from model_worker.registration import Capacity, Record, Registration, RegistrationThread
    from wire.messages import PROTOCOL_VERSION

    record = Record(
        worker_id=args.worker_id,
        model=spec.name,
        replica=args.replica,
        endpoint=_advertised(args.listen, args.advertise),
        public_key=public_key.decode("ascii"),
        capacity=Capacity(max_jobs=spec.max_jobs, max_queue=spec.max_queue) if spec.max_jobs else None,
        protocol_version=PROTOCOL_VERSION,
    )
    registration = Registration(
        record,
        target.endpoints,
        prefix=target.prefix,
        ttl_s=target.ttl_s,
        request_timeout_s=target.request_timeout_s,
        retry_interval_s=target.retry_interval_s,
    )
    thread = RegistrationThread(registration)
    thread.start()
    return thread


def _reread_spec(config: str, model: str) -> WorkerSpec:
    """The model's entry as the registry file says now (RemoteSpecError if it cannot)."""
    from model_worker.remote_spec import remote_spec

    return remote_spec(config, model)


def _has_leader(args: argparse.Namespace) -> bool:
    """Whether a leading gateway may load this worker's model on demand: only a listening worker
    registered in etcd stands by (anywhere else a standby worker would wait forever)."""
    if args.listen is None:
        return False
    from model_worker.etcd_target import RegistrationConfigError, etcd_target

    try:
        return etcd_target(args.config) is not None
    except RegistrationConfigError as exc:
        raise SystemExit(f"model-worker: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = _spec(args)
    if args.worker_id is None:
        raise SystemExit("model-worker: --worker-id is required with --spec")
    if args.listen is not None:
        if args.spec is not None or args.parent_pid is not None:
            raise SystemExit("model-worker: --listen is for workers of their own (--config and --model)")
        if not args.listen.startswith("tcp://") or args.curve_secret_key is None:
            raise SystemExit(
                "model-worker: --listen needs tcp://HOST:PORT, --curve-secret-key and --gateway-public-key"
            )
    elif args.connect.startswith("tcp://") and args.curve_secret_key is None:
        raise SystemExit("model-worker: a tcp connection needs --curve-secret-key and --gateway-public-key")
    keys = _curve_keys(args)
    if spec.standby and not _has_leader(args):
        spec = dataclasses.replace(spec, standby=False)
    try:
        fmt = log_format.resolve_format(args.log_format, os.environ)  # LOG_FORMAT: from a spawning gateway
    except ValueError:
        fmt = "text"  # the gateway checked it already; a worker never fails over how it logs
    context = log_format.StaticContext(worker=args.worker_id)
    log_format.install(args.log_level, fmt, context)
    # The model's own environment (registry `env`), like CUDA_VISIBLE_DEVICES before any torch import.
    os.environ.update(spec.env)
    if args.gpus is not None:
        # Must precede any torch import (engines import torch lazily) or CUDA sees every GPU.
        os.environ["CUDA_VISIBLE_DEVICES"] = args.gpus
    _one_cpu_thread_for_gpu_workers()
    if args.parent_pid is not None:  # spawned by a local gateway: never outlive it
        _die_with_parent()
    context.fields["model"] = spec.name
    if spec.engine == "transformers":
        _route_transformers_logs()

    from model_worker import tracing
    from model_worker.serve_loop import Worker

    tracing.start(args.worker_id, spec.name)  # only when the OTEL_* variables ask for it
    registration = None
    if args.listen is not None:
        assert keys is not None  # checked above
        public, secret, gateways = keys
        listen = (public, secret, frozenset(gateways))
        worker = Worker(
            args.worker_id, args.listen, spec, parent_pid=None, listen=listen,
            reread_spec=functools.partial(_reread_spec, args.config, args.model),
        )  # fmt: skip
        # Registered once the socket exists: a gateway that connects before the bind just retries.
        registration = _registration(args, spec, public)
    else:
        curve = (keys[0], keys[1], keys[2][0]) if keys is not None else None
        worker = Worker(args.worker_id, args.connect, spec, parent_pid=args.parent_pid, curve=curve)
    # A local worker is drained by its gateway (Shutdown with a grace); a remote one drains itself.
    grace_s = (
        args.shutdown_grace_s if args.shutdown_grace_s is not None else (0.0 if args.parent_pid else 30.0)
    )
    signal.signal(signal.SIGTERM, lambda *_: worker.request_stop(grace_s=grace_s))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the gateway decides
    try:
        return worker.run()
    finally:
        if registration is not None:  # revoked after the drain: every gateway forgets this worker now
            registration.stop()
        tracing.stop()  # the last spans are exported before the process exits


if __name__ == "__main__":
    raise SystemExit(main())
