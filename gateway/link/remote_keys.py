"""The keys of workers allowed to join over tcp, and which models each key may serve.

Runs in the gateway process, on its asyncio loop (the CURVE handshake check and every remote frame
consult it). Owns the live view of `server.remote_workers.authorized_keys_dir`: one ZeroMQ public
certificate per worker key (`gateway keys DIR --name NAME --models A,B`), whose metadata names the
models it may serve. The folder is re-read when it changes, so a key removed from it is refused from
the next frame on, without a restart. Keys are named in logs by their file name, never shown whole.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

logger = logging.getLogger(__name__)

REFRESH_EVERY_S = 1.0


@dataclass(frozen=True)
class WorkerKey:
    name: str  # the certificate's file name without .key: what logs show
    public_z85: str
    models: frozenset[str]  # the models workers with this key may serve ("*": every remote model)

    def allows(self, model: str) -> bool:
        return "*" in self.models or model in self.models


def key_label(public_z85: str | None) -> str:
    """How an unknown key appears in logs: enough to find it, not the whole key."""
    return f"unknown key {public_z85[:8]}..." if public_z85 else "no key"


def read_metadata(path: Path) -> dict[str, str]:
    """The `metadata` section of a ZeroMQ certificate file (`name = value` lines)."""
    values: dict[str, str] = {}
    section = ""
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not line[:1].isspace():
            section = stripped
            continue
        if section == "metadata" and "=" in stripped:
            name, _, value = stripped.partition("=")
            values[name.strip()] = value.strip().strip('"')
    return values


def set_models(public_certificate: Path, models: str) -> None:
    """Name the models a worker key may serve in its public certificate's metadata section (pyzmq
    writes metadata into the secret certificate only, and the gateway keeps only public ones)."""
    lines = public_certificate.read_text(encoding="utf-8").splitlines()
    at = lines.index("metadata") + 1
    lines = lines[:at] + [line for line in lines[at:] if not line.strip().startswith("models")]
    lines.insert(at, f"    models = {models}")
    public_certificate.write_text("\n".join(lines) + "\n", encoding="utf-8")


class AuthorizedKeys:
    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._by_key: dict[str, WorkerKey] = {}
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._checked_at = 0.0
        self.refresh(force=True)

    def __len__(self) -> int:
        return len(self._by_key)

    def _current_signature(self) -> tuple[tuple[str, int, int], ...]:
        try:
            files = sorted(self.folder.glob("*.key"))
            return tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size) for f in files)
        except OSError:
            return ()

    def refresh(self, force: bool = False) -> None:
        """Re-read the folder if it changed; at most once per REFRESH_EVERY_S unless forced."""
        now = time.monotonic()
        if not force and now - self._checked_at < REFRESH_EVERY_S:
            return
        self._checked_at = now
        signature = self._current_signature()
        if signature == self._signature:
            return
        self._signature = signature
        keys: dict[str, WorkerKey] = {}
        for name, _, _ in signature:
            path = self.folder / name
            try:
                public, _ = zmq.auth.load_certificate(str(path))
                models = read_metadata(path).get("models", "")
            except (OSError, ValueError) as exc:
                logger.error("authorized worker key %s cannot be read: %s", path.name, exc)
                continue
            allowed = frozenset(m.strip() for m in models.split(",") if m.strip())
            if not allowed:
                logger.warning(
                    "authorized worker key %s names no models; workers with it are refused", path.stem
                )
            keys[public.decode()] = WorkerKey(path.stem, public.decode(), allowed)
        removed = {k.name for k in self._by_key.values()} - {k.name for k in keys.values()}
        if self._by_key and removed:
            logger.warning(
                "worker key(s) removed from %s: %s; refused from now on", self.folder, sorted(removed)
            )
        self._by_key = keys

    def lookup(self, public_z85: str | None) -> WorkerKey | None:
        self.refresh()
        return self._by_key.get(public_z85 or "")

    def callback(self, domain: str, public_z85: bytes) -> bool:
        """The CURVE handshake check (pyzmq's credentials provider): only keys in the folder now."""
        key = self.lookup(public_z85.decode("ascii", "replace"))
        if key is None:
            logger.warning(
                "remote worker handshake refused: %s", key_label(public_z85.decode("ascii", "replace"))
            )
        return key is not None
