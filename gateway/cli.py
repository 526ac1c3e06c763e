"""The `gateway` command: serve, check-config, make-demo-model.

Runs in the gateway process (serve) or a short-lived CLI process. Owns argument parsing and the
operator-facing messages: a bad registry prints one clear line per problem and exits 2, with no
traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from gateway.config.api_keys import check_bind_allowed, keys_file_path, parse_keys_file
from gateway.config.placement import check_placement, discover_gpus
from gateway.config.registry import ConfigError, Registry, load_registry
from gateway.observability.logging_setup import configure_logging
from wire.log_format import FORMATS, resolve_format

DEFAULT_CONFIG = "config/models.yaml"


def _cmd_serve(args: argparse.Namespace) -> int:
    registry = load_registry(args.config)
    host = args.host or os.environ.get("HOST") or registry.server.host
    port = int(args.port if args.port is not None else os.environ.get("PORT") or registry.server.port)
    check_bind_allowed(registry, host, os.environ)  # no keys: loopback only
    _check_placement(registry)
    if registry.server.remote_workers is not None:
        from gateway.serving.worker_link import check_remote_keys

        check_remote_keys(registry.server.remote_workers)  # a tcp listener without keys never starts
    from gateway.server import run_server

    asyncio.run(run_server(registry, host, port))
    return 0


def _check_placement(registry: Registry) -> None:
    if not any(model.gpus or model.replica_gpus for model in registry.models):
        return  # CPU-only registry: nothing to place
    errors, warnings = check_placement(registry, discover_gpus())
    for warning in warnings:
        logging.getLogger("gateway.config.placement").warning("%s", warning)
    if errors:
        raise ConfigError(f"{registry.source}: " + f"\n{registry.source}: ".join(errors))


def _cmd_check_config(args: argparse.Namespace) -> int:
    registry = load_registry(args.config)
    for model in registry.models:
        missing = "" if model.path.exists() else "  (path does not exist yet)"
        placements = [model.gpus_of_replica(r) for r in range(model.replicas)]
        where = "remote" if model.remote else ", ".join(f"gpus {g}" if g else "cpu" for g in placements)
        print(f"ok: {model.name} [{model.engine}, {where}] {model.path}{missing}")
    keys_path = keys_file_path(registry)
    if keys_path is not None:
        print(f"ok: API keys file {keys_path} ({len(parse_keys_file(keys_path, registry))} key(s))")
    return 0


def _cmd_make_demo_model(args: argparse.Namespace) -> int:
    if args.embedding:
        from gateway.demo.embedding_model import make_demo_embedding_model

        out = make_demo_embedding_model(Path(args.dir), preset=args.preset, seed=args.seed)
        print(f"wrote {out}")
        return 0
    from gateway.demo.model import make_demo_model

    out = make_demo_model(Path(args.dir), preset=args.preset, seed=args.seed, device=args.device)
    print(f"wrote {out}")
    return 0


def _cmd_keys(args: argparse.Namespace) -> int:
    """CURVE key pairs for the gateway and for remote workers (ZeroMQ's certificate files)."""
    import zmq.auth

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name in args.name:
        if (folder / f"{name}.key_secret").exists():
            raise ConfigError(f"{folder / name}.key_secret exists; refusing to overwrite a key")
        public_file, secret_file = zmq.auth.create_certificates(str(folder), name)
        Path(secret_file).chmod(0o600)
        print(f"wrote {public_file} (public: share it) and {secret_file} (secret: keep it on its host)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="OpenAI-compatible multi-model LLM gateway")
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway and its workers")
    serve.add_argument("--config", default=os.environ.get("CONFIG", DEFAULT_CONFIG))
    serve.add_argument("--host", default=None, help="default: $HOST, then the registry's server.host")
    serve.add_argument(
        "--port", type=int, default=None, help="default: $PORT, then the registry's server.port"
    )
    serve.add_argument(
        "--log-format",
        choices=FORMATS,
        default=None,
        help="text or json (one object per line); default: $LOG_FORMAT, then text",
    )
    serve.set_defaults(func=_cmd_serve)
    check = sub.add_parser("check-config", help="validate a registry file without starting anything")
    check.add_argument("config", nargs="?", default=os.environ.get("CONFIG", DEFAULT_CONFIG))
    check.set_defaults(func=_cmd_check_config)
    keys = sub.add_parser("keys", help="generate CURVE key pairs for the gateway and remote workers")
    keys.add_argument("dir")
    keys.add_argument("--name", action="append", required=True, help="e.g. gateway, worker-a (repeatable)")
    keys.set_defaults(func=_cmd_keys)
    demo = sub.add_parser("make-demo-model", help="write a small random-weight model folder (offline)")
    demo.add_argument("dir")
    demo.add_argument("--preset", default="small")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu")
    demo.add_argument(
        "--embedding", action="store_true", help="a sentence-transformers embedding model (mean pooling)"
    )
    demo.set_defaults(func=_cmd_make_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        log_format = resolve_format(getattr(args, "log_format", None), os.environ)
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        # Workers inherit the environment, so their lines come out in the same format.
        os.environ["LOG_FORMAT"] = log_format
    configure_logging(args.log_level, log_format)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
