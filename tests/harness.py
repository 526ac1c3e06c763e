"""Test harness: a real gateway process on a free port, started and stopped by the tests.

Runs in the pytest process. Owns `GatewayProcess`, which spawns `python -m gateway serve`, waits
for readiness over HTTP, and on exit sends SIGTERM and checks that the gateway exits; and
`wait_until` / `async_wait_until`, the one way tests wait for something to happen (never a sleep).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, overload

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
# Generous on purpose: on 2 busy cores a model load alone took over 30 s in our runs. A wait ends
# as soon as its event happens, so a long limit costs nothing when all is well.
WAIT_TIMEOUT_S = 120.0
_FIRST_POLL_S, _MAX_POLL_S = 0.01, 0.2
_LOG_TAIL_CHARS = 4000


class WaitTimeout(AssertionError):
    """What wait_until raises: the event never happened within its time."""


def _poll_intervals(cap: float) -> Iterator[float]:
    """Short first (most events are near), then backing off so a long wait costs little CPU."""
    interval = min(_FIRST_POLL_S, cap)
    while True:
        yield interval
        interval = min(interval * 1.5, cap)


def _timed_out(what: str, timeout: float, last: object, context: Callable[[], object] | None) -> WaitTimeout:
    message = f"timed out after {timeout:g}s waiting for {what}; the last check gave {last!r}"
    if context is not None:
        message += "\n" + str(context())[-_LOG_TAIL_CHARS:]
    return WaitTimeout(message)


def wait_until(
    predicate: Callable[[], T | None],
    what: str,
    timeout: float = WAIT_TIMEOUT_S,
    *,
    context: Callable[[], object] | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
    poll_s: float = _MAX_POLL_S,
) -> T:
    """Poll `predicate` until it returns something truthy, and return that. On timeout fail with
    `what` (the event awaited, as a phrase), the last value and `context()` (e.g. `gateway.events`,
    whose tail is shown). Exceptions of `retry_on` count as "not yet"; any other propagates, so a
    predicate can fail fast (a process that died will not become ready). `poll_s` caps the pause
    between checks: lower it only for a predicate that records short-lived states on the way."""
    deadline = time.monotonic() + timeout
    pauses = _poll_intervals(poll_s)
    while True:
        try:
            last: Any = predicate()
        except retry_on as exc:
            last = exc
        else:
            if last:
                return last  # type: ignore[no-any-return]
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last, context)
        time.sleep(next(pauses))


@overload
async def async_wait_until(
    predicate: Callable[[], Awaitable[T | None]],
    what: str,
    timeout: float = ...,
    *,
    context: Callable[[], object] | None = ...,
    retry_on: tuple[type[BaseException], ...] = ...,
    poll_s: float = ...,
) -> T: ...


@overload
async def async_wait_until(
    predicate: Callable[[], T | None],
    what: str,
    timeout: float = ...,
    *,
    context: Callable[[], object] | None = ...,
    retry_on: tuple[type[BaseException], ...] = ...,
    poll_s: float = ...,
) -> T: ...


async def async_wait_until(
    predicate: Callable[[], Any],
    what: str,
    timeout: float = WAIT_TIMEOUT_S,
    *,
    context: Callable[[], object] | None = None,
    retry_on: tuple[type[BaseException], ...] = (),
    poll_s: float = _MAX_POLL_S,
) -> Any:
    """wait_until for a test's event loop: the predicate may be a coroutine function, and the
    pauses let the loop run what the test waits for."""
    deadline = time.monotonic() + timeout
    pauses = _poll_intervals(poll_s)
    while True:
        try:
            last: Any = predicate()
            if inspect.isawaitable(last):
                last = await last
        except retry_on as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            raise _timed_out(what, timeout, last, context)
        await asyncio.sleep(next(pauses))


async def settle(turns: int = 20) -> None:
    """Let every callback that is ready run (a woken waiter takes a few loop turns), so a test of
    asyncio code without I/O can check that something did *not* happen: nothing else can arrive
    later. Yields to the loop; never a wall-clock wait."""
    for _ in range(turns):
        await asyncio.sleep(0)


_ports_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before in this process: the kernel may give
    the same ephemeral port to two binds in a row once the first socket is closed (an etcd once got
    one port for its client and its peer URLs, and failed to start)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _ports_handed_out:
            _ports_handed_out.add(port)
            return port


@contextlib.contextmanager
def dealer_and_router(folder: Path, small_buffers: bool = False) -> Iterator[tuple[Any, Any]]:
    """A worker's DEALER (identity b"w") connected to a gateway's ROUTER over ipc in `folder`;
    small_buffers: one message of high-water mark and 4 KiB of socket buffer each, so that a
    sender feels back-pressure at once."""
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    dealer = ctx.socket(zmq.DEALER)
    if small_buffers:
        router.setsockopt(zmq.RCVHWM, 1)
        router.setsockopt(zmq.RCVBUF, 4096)
        dealer.setsockopt(zmq.SNDHWM, 1)
        dealer.setsockopt(zmq.SNDBUF, 4096)
    endpoint = f"ipc://{folder}/s"
    router.bind(endpoint)
    dealer.setsockopt(zmq.IDENTITY, b"w")
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        yield dealer, router
    finally:
        dealer.close(0)
        router.close(0)
        ctx.term()


def make_keys(folder: Path, *names: str) -> None:
    """Curve key pairs for a cluster test, one per name, made by the gateway's own `keys` command."""
    cmd = [sys.executable, "-m", "gateway", "keys", str(folder)]
    for name in names:
        cmd += ["--name", name]
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, capture_output=True)


class GatewayProcess:
    def __init__(
        self,
        config_path: Path,
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = 120.0,
        wait_ready: bool = True,
        log_path: Path | None = None,
        port: int | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        self.config_path = Path(config_path)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self.wait_ready = wait_ready
        # Prepend, not replace: a GPU host puts carried wheels on PYTHONPATH too.
        python_path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        self.env = {**os.environ, "PYTHONPATH": python_path, **(env or {})}
        self.log_path = log_path or self.config_path.with_suffix(f".{self.port}.log")
        self.process: subprocess.Popen[bytes] | None = None
        self.args = args  # more `gateway serve` flags

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def __enter__(self) -> GatewayProcess:
        self._log = open(self.log_path, "wb")
        cmd = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(self.config_path),
            "--port",
            str(self.port),
            *self.args,
        ]
        self.process = subprocess.Popen(
            cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO_ROOT
        )
        if self.wait_ready:
            try:
                self.wait_until_ready(self.ready_timeout)
            except BaseException:  # __exit__ never runs for a failed __enter__: stop it and close its log
                try:
                    self.stop()
                finally:
                    self._log.close()
                raise
        return self

    def _check_running(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None:  # it will not become ready: fail now, not at the timeout
            raise RuntimeError(f"gateway exited with {self.process.returncode}:\n{self.log()}")

    def _check_no_model_failed(self, models: dict[str, Any]) -> None:
        """A model whose every replica gave up will not become ready: fail now, not at the timeout."""
        for name, view in models.items():
            replicas = view.get("replicas") or []
            if replicas and all(r.get("state") == "failed" for r in replicas):
                raise RuntimeError(f"model {name!r} failed to start: {replicas[0].get('last_error')}")

    def wait_until_ready(self, timeout: float) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            self._check_running()
            response = httpx.get(self.url + "/health/ready", timeout=2)
            if response.status_code == 200:
                return response.json()
            self._check_no_model_failed(response.json().get("models") or {})
            return None

        return wait_until(
            ready, "the gateway to be ready", timeout, context=self.events, retry_on=(httpx.HTTPError,)
        )

    def wait_until_live(self, timeout: float = 60.0) -> None:
        """The HTTP server answers (models may still be loading, or have no worker yet)."""

        def live() -> bool:
            self._check_running()
            return httpx.get(self.url + "/health/live", timeout=1).status_code == 200

        wait_until(live, "the gateway to be live", timeout, context=self.events, retry_on=(httpx.HTTPError,))

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/admin/workers", timeout=5).json()["workers"]  # type: ignore[no-any-return]

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-20000:]

    def events(self) -> str:
        """The log without its access lines, for a failed wait: a test that polls the API writes one
        line per poll, and they would bury what happened."""
        self._log.flush()
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines if " gateway.access: " not in line)[-20000:]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise
        return self.process.returncode

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        try:
            self.stop()
        finally:
            self._log.close()
        if exc_type is None:
            # Every gateway a test runs also checks the worker state table (wire.states): a state
            # change outside it is a bug that the gateway logs and refuses.
            invalid = [line for line in self.log_path.read_text(errors="replace").splitlines()
                       if "invalid worker state transition" in line]  # fmt: skip
            assert not invalid, "\n".join(invalid)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes: it holds no memory or GPU.
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def settled_workers(gateway: GatewayProcess, wanted: list[str] | None = None) -> list[dict[str, Any]]:
    """The ready workers (or those named) once each is idle in a heartbeat received after this call
    began. Frames from a worker arrive in order, so such a heartbeat was sent after the last Step of
    every request already answered: its counters include them all. An idle heartbeat received
    earlier may predate the last of those jobs (it was admitted and finished between two beats)."""

    def chosen() -> list[dict[str, Any]]:
        workers = gateway.workers()
        return [w for w in workers if (w["id"] in wanted if wanted else w["state"] == "ready")]

    seen = {w["id"]: w["heartbeats"] for w in chosen()}

    def settled() -> list[dict[str, Any]] | None:
        workers = chosen()
        fresh = all(w["heartbeats"] > seen.get(w["id"], -1) for w in workers)
        idle = all(w["active_jobs"] == 0 and w["queued_jobs"] == 0 and w["in_flight"] == 0 for w in workers)
        return workers if workers and fresh and idle else None

    return wait_until(settled, "every worker to be idle in a fresh heartbeat", context=gateway.events)
