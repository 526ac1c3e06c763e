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
(`pip install uvicorn httptools uvloop granian`).

    python bench/bench_sse_floor.py --streams 1,16,64 --tokens 128 --rounds 3
    python bench/bench_sse_floor.py --servers hypercorn,uvicorn,granian --streams 16,64 --tokens 512
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


def bare_app(step_s: float) -> Any:
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


def __getattr__(name: str) -> Any:
    # Granian imports its app by name in a process of its own: built there, on first access.
    if name == "granian_app":
        return bare_app(float(os.environ["SSE_FLOOR_STEP_S"]))
    raise AttributeError(name)


def serve(server: str, port: int, step_s: float) -> None:
    if server == "uvicorn":
        import uvicorn

        uvicorn.run(bare_app(step_s), host="127.0.0.1", port=port, loop="auto", http="httptools",
                    access_log=False, log_level="warning")  # fmt: skip
    elif server == "granian":
        from granian import Granian

        os.environ["SSE_FLOOR_STEP_S"] = str(step_s)
        Granian("bench.bench_sse_floor:granian_app", address="127.0.0.1", port=port, interface="asgi",
                workers=1, loop="auto", log_access=False).serve()  # fmt: skip
    else:
        from hypercorn.asyncio import serve as hypercorn_serve
        from hypercorn.config import Config

        config = Config()
        config.bind = [f"127.0.0.1:{port}"]
        config.accesslog = None
        asyncio.run(hypercorn_serve(bare_app(step_s), config))  # type: ignore[arg-type]


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


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(server: str, step_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--server", server, "--step-ms", str(step_ms)],
        cwd=REPO_ROOT,
    )
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
            servers[server] = start_server(server, args.step_ms)
        rows = []
        for count in args.streams:
            prompts = [f"stream {i}" for i in range(count)]
            per_token: dict[str, list[float]] = {server: [] for server in servers}
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
            first = args.servers[0]
            for server, values in per_token.items():
                paired = [v / f for v, f in zip(values, per_token[first], strict=True)]
                rows.append({"server": server, "streams": count, "us_per_token": statistics.median(values),
                             "min": min(values), "max": max(values), "rounds": values,
                             "ratio": statistics.median(paired), "ratio_min": min(paired),
                             "ratio_max": max(paired)})  # fmt: skip
        return rows
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--server", choices=SERVERS, default="hypercorn", help=argparse.SUPPRESS)
    parser.add_argument("--servers", type=lambda s: s.split(","), default=["hypercorn"],
                        help=f"ASGI servers to serve the bare app with, side by side ({', '.join(SERVERS)}); "
                             "ratios are to the first")  # fmt: skip
    parser.add_argument("--streams", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=16.0, help="how often every stream gets a token")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.serve:
        serve(args.server, args.serve, args.step_ms / 1000)
        return
    if unknown := [server for server in args.servers if server not in SERVERS]:
        parser.error(f"unknown server {', '.join(unknown)}; choose from {', '.join(SERVERS)}")
    rows = measure(args)
    print(f"bare Quart app, {os.cpu_count()} CPUs, {args.tokens} tokens per stream, a step every "
          f"{args.step_ms:g} ms, median of {args.rounds} interleaved rounds")  # fmt: skip
    first = args.servers[0]
    print(f"| server | streams | app CPU us per streamed token (min-max) | ÷ {first}, paired (min-max) |")
    print("|---|---|---|---|")
    for row in rows:
        spread = f"{row['min']:.1f}-{row['max']:.1f}"
        paired = f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f}"
        print(f"| {row['server']} | {row['streams']} | {row['us_per_token']:.1f} ({spread}) "
              f"| {row['ratio']:.3f} ({paired}) |")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
