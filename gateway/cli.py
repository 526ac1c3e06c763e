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

from gateway.api_keys import check_bind_allowed, keys_file_path, parse_keys_file
from gateway.config import ConfigError, Registry, load_registry
from gateway.placement import check_placement, discover_gpus

DEFAULT_CONFIG = "config/models.yaml"


def _cmd_serve(args: argparse.Namespace) -> int:
    registry = load_registry(args.config)
    host = args.host or os.environ.get("HOST") or registry.server.host
    port = int(args.port if args.port is not None else os.environ.get("PORT") or registry.server.port)
    check_bind_allowed(registry, host, os.environ)  # no keys: loopback only
    _check_placement(registry)
    from gateway.server import run_server

    asyncio.run(run_server(registry, host, port))
    return 0


def _check_placement(registry: Registry) -> None:
    if not any(model.gpus for model in registry.models):
        return  # CPU-only registry: nothing to place
    errors, warnings = check_placement(registry, discover_gpus())
    for warning in warnings:
        logging.getLogger("gateway.placement").warning("%s", warning)
    if errors:
        raise ConfigError(f"{registry.source}: " + f"\n{registry.source}: ".join(errors))


def _cmd_check_config(args: argparse.Namespace) -> int:
    registry = load_registry(args.config)
    for model in registry.models:
        missing = "" if model.path.exists() else "  (path does not exist yet)"
        where = f"gpus {model.gpus}" if model.gpus else "cpu"
        print(f"ok: {model.name} [{model.engine}, {where}] {model.path}{missing}")
    keys_path = keys_file_path(registry)
    if keys_path is not None:
        print(f"ok: API keys file {keys_path} ({len(parse_keys_file(keys_path, registry))} key(s))")
    return 0


def _cmd_make_demo_model(args: argparse.Namespace) -> int:
    from gateway.demo_model import make_demo_model

    out = make_demo_model(Path(args.dir), preset=args.preset, seed=args.seed, device=args.device)
    print(f"wrote {out}")
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
    serve.set_defaults(func=_cmd_serve)
    check = sub.add_parser("check-config", help="validate a registry file without starting anything")
    check.add_argument("config", nargs="?", default=os.environ.get("CONFIG", DEFAULT_CONFIG))
    check.set_defaults(func=_cmd_check_config)
    demo = sub.add_parser("make-demo-model", help="write a small random-weight model folder (offline)")
    demo.add_argument("dir")
    demo.add_argument("--preset", default="small")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu")
    demo.set_defaults(func=_cmd_make_demo_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
