"""The floor under the gateway's CPU per streamed token: a bare Quart app on Hypercorn streaming SSE.

Runs as a standalone process (the bench process) that starts a second one (`--serve PORT`, the
bare app) on the same host; no model, no GPU, no worker. The bare app has one route shaped like
/v1/completions with `stream: true`: a producer task wakes every `--step-ms` (one engine step) and
puts one token on every open stream's asyncio.Queue, and each stream writes one SSE chunk per token
in the OpenAI completions shape, then a usage chunk and `[DONE]`. So it pays what the gateway cannot
avoid while it keeps Quart and Hypercorn (request handling, one pass per chunk through Quart,
Hypercorn and h11, one send(2), one event-loop wake-up per step) and nothing of the gateway's own.
The same client as bench/bench_engines.py (bench/streams.py) drives it at each concurrency, over
interleaved rounds, and the app's CPU per streamed token is read from /proc (schedstat, every
thread of the server's process and of its children). Put beside bench_engines.py's "gateway CPU
us/token" on the same host, the difference is what the gateway itself spends per token.

`--servers` serves the same Quart app with other ASGI servers too, side by side and interleaved,
to show what the choice of server costs per chunk: `uvicorn` (httptools, and uvloop where
installed) and `granian`. They are not dependencies of the project; install them to compare
(`pip install uvicorn httptools uvloop granian`). `hypercorn:N` serves it with N Hypercorn
processes on one socket, each with its own event loop (the app holds no state across requests).

`--first-at-once` writes each stream's first chunk as soon as its request is handled, instead of at
the next step: the time to first token is then what the server takes to admit a request and write
its first chunk, and at 64 streams started together, how long a burst waits for one event loop to
admit it. Every row reports the client's time to first token (median of the rounds' medians).

    python bench/bench_sse_floor.py --streams 1,16,64 --tokens 128 --rounds 3
    python bench/bench_sse_floor.py --servers hypercorn,uvicorn,granian --streams 16,64 --tokens 512
    python bench/bench_sse_floor.py --servers hypercorn,hypercorn:4 --first-at-once --streams 1,64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import httpx  # noqa: E402

from bench.proc_cpu import run_seconds  # noqa: E402
from bench.streams import http_round  # noqa: E402

SERVERS = ("hypercorn", "uvicorn", "granian")


def bare_app(step_s: float, first_at_once: bool = False) -> Any:
    from quart import Quart, Response, request

    app = Quart("sse-floor")
    open_streams: set[asyncio.Queue[int]] = set()

    async def steps() -> None:
        while True:
            await asyncio.sleep(step_s)
            for queue in open_streams:
                queue.put_nowait(1)

    @app.before_serving
    async def start_steps() -> None:
        app.add_background_task(steps)

    @app.get("/health")
    async def health() -> str:
        return "ok"

    @app.post("/v1/completions")
    async def completions() -> Response:
        body = await request.get_json()
        tokens = int(body["max_tokens"])
        queue: asyncio.Queue[int] = asyncio.Queue()

        async def chunks() -> Any:
            open_streams.add(queue)
            if first_at_once:
                queue.put_nowait(1)
            try:
                for index in range(tokens):
                    await queue.get()
                    choice = {"index": 0, "text": f" w{index}", "logprobs": None, "finish_reason": None}
                    yield (
                        b"data: "
                        + json.dumps({"object": "text_completion", "choices": [choice]}).encode()
                        + b"\n\n"
                    )
            finally:
                open_streams.discard(queue)
            usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
            yield b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n"

        return Response(chunks(), content_type="text/event-stream")

    return app


class ServedApp:
    """The bare app as Granian and Hypercorn's worker processes load it, by name: built in the
    process that serves it, on its first call, from what serve() put in the environment."""

    def __init__(self) -> None:
        self._app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if self._app is None:
            first_at_once = os.environ["SSE_FLOOR_FIRST_AT_ONCE"] == "1"
            self._app = bare_app(float(os.environ["SSE_FLOOR_STEP_S"]), first_at_once)
        await self._app(scope, receive, send)


served_app = ServedApp()


def hypercorn_processes(server: str) -> int:
    """`hypercorn` is one process; `hypercorn:N` is N of them on one socket."""
    name, _, count = server.partition(":")
    if name != "hypercorn" or (count and (not count.isdigit() or int(count) < 1)):
        raise ValueError(server)
    return int(count or 1)


def serve(server: str, port: int, step_s: float, first_at_once: bool) -> None:
    os.environ["SSE_FLOOR_STEP_S"] = str(step_s)
    os.environ["SSE_FLOOR_FIRST_AT_ONCE"] = "1" if first_at_once else "0"
    if server == "uvicorn":
        import uvicorn

        uvicorn.run(bare_app(step_s, first_at_once), host="127.0.0.1", port=port, loop="auto",
                    http="httptools", access_log=False, log_level="warning")  # fmt: skip
    elif server == "granian":
        from granian import Granian

        Granian("bench.bench_sse_floor:served_app", address="127.0.0.1", port=port, interface="asgi",
                workers=1, loop="auto", log_access=False).serve()  # fmt: skip
    else:
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"127.0.0.1:{port}"]
        config.accesslog = None
        processes = hypercorn_processes(server)
        if processes == 1:
            from hypercorn.asyncio import serve as hypercorn_serve

            asyncio.run(hypercorn_serve(bare_app(step_s, first_at_once), config))  # type: ignore[arg-type]
        else:
            from hypercorn.run import run

            config.application_path = "bench.bench_sse_floor:served_app"
            config.workers = processes
            run(config)


def tree_run_seconds(pid: int) -> float:
    """CPU time of a process and of its children (Granian serves from a child process)."""
    total = run_seconds(pid)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid:
                total += run_seconds(int(stat.parent.name))
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue
    return total


def known_server(server: str) -> bool:
    if server in SERVERS:
        return True
    try:
        return hypercorn_processes(server) >= 1
    except ValueError:
        return False


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(server: str, step_ms: float, first_at_once: bool) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [sys.executable, __file__, "--serve", str(port), "--server", server, "--step-ms", str(step_ms)]
    process = subprocess.Popen(command + (["--first-at-once"] if first_at_once else []), cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1).raise_for_status()
            return process, url
        except httpx.HTTPError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise RuntimeError(f"the bare app on {server} did not start") from None
            time.sleep(0.1)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each server's CPU per streamed token at each concurrency, rounds interleaved across servers."""
    servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    try:
        for server in args.servers:
            servers[server] = start_server(server, args.step_ms, args.first_at_once)
        rows = []
        for count in args.streams:
            prompts = [f"stream {i}" for i in range(count)]
            per_token: dict[str, list[float]] = {server: [] for server in servers}
            ttft_ms: dict[str, list[float]] = {server: [] for server in servers}
            for _, url in servers.values():
                http_round(url, "floor", prompts, args.tokens, None)  # warm-up
            for round_index in range(args.rounds):
                # The order turns every round, so no server always runs right after the same one.
                order = list(servers.items())
                order = order[round_index % len(order) :] + order[: round_index % len(order)]
                for server, (process, url) in order:
                    before = tree_run_seconds(process.pid)
                    done = http_round(url, "floor", prompts, args.tokens, None)
                    used = tree_run_seconds(process.pid) - before
                    per_token[server].append(1e6 * used / sum(s.tokens for s in done.streams))
                    ttft_ms[server].append(1000 * done.ttft_p50)
            first = args.servers[0]
            for server, values in per_token.items():
                paired = [v / f for v, f in zip(values, per_token[first], strict=True)]
                rows.append({"server": server, "streams": count, "us_per_token": statistics.median(values),
                             "min": min(values), "max": max(values), "rounds": values,
                             "ratio": statistics.median(paired), "ratio_min": min(paired),
                             "ratio_max": max(paired), "ttft_ms_p50": statistics.median(ttft_ms[server]),
                             "ttft_ms_min": min(ttft_ms[server]), "ttft_ms_max": max(ttft_ms[server]),
                             "ttft_rounds": ttft_ms[server]})  # fmt: skip
        return rows
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--server", default="hypercorn", help=argparse.SUPPRESS)
    parser.add_argument("--servers", type=lambda s: s.split(","), default=["hypercorn"],
                        help=f"ASGI servers to serve the bare app with, side by side ({', '.join(SERVERS)}, "
                             "hypercorn:N for N processes); ratios are to the first")  # fmt: skip
    parser.add_argument(
        "--first-at-once",
        action="store_true",
        help="each stream's first chunk as soon as its request is handled, not at the next step",
    )
    parser.add_argument("--streams", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=16.0, help="how often every stream gets a token")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.serve:
        serve(args.server, args.serve, args.step_ms / 1000, args.first_at_once)
        return
    if unknown := [server for server in args.servers if not known_server(server)]:
        parser.error(f"unknown server {', '.join(unknown)}; choose from {', '.join(SERVERS)} or hypercorn:N")
    rows = measure(args)
    first_chunk = "the first chunk at once" if args.first_at_once else "the first chunk at the next step"
    print(f"bare Quart app, {os.cpu_count()} CPUs, {args.tokens} tokens per stream, a step every "
          f"{args.step_ms:g} ms, {first_chunk}, median of {args.rounds} interleaved rounds")  # fmt: skip
    first = args.servers[0]
    print(f"| server | streams | app CPU us per streamed token (min-max) | ÷ {first}, paired (min-max) "
          "| TTFT p50 ms (min-max) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for row in rows:
        spread = f"{row['min']:.1f}-{row['max']:.1f}"
        paired = f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
        ttft = f"{row['ttft_ms_p50']:.1f} ({row['ttft_ms_min']:.1f}-{row['ttft_ms_max']:.1f})"
        print(f"| {row['server']} | {row['streams']} | {row['us_per_token']:.1f} ({spread}) "
              f"| {row['ratio']:.3f} ({paired}) | {ttft} |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
