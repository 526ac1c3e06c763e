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
thread). Put beside bench_engines.py's "gateway CPU us/token" on the same host, the difference is
what the gateway itself spends per token.

    python bench/bench_sse_floor.py --streams 1,16,64 --tokens 128 --rounds 3
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


def serve(port: int, step_s: float) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config
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

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    asyncio.run(hypercorn_serve(app, config))  # type: ignore[arg-type]


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(port), "--step-ms", str(args.step_ms)]
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the bare app did not start") from None
                time.sleep(0.1)
        rows = []
        for count in args.streams:
            prompts = [f"stream {i}" for i in range(count)]
            http_round(url, "floor", prompts, args.tokens, None)  # warm-up
            per_token = []
            for _ in range(args.rounds):
                before = run_seconds(server.pid)
                done = http_round(url, "floor", prompts, args.tokens, None)
                used = run_seconds(server.pid) - before
                per_token.append(1e6 * used / sum(s.tokens for s in done.streams))
            rows.append({"streams": count, "us_per_token": statistics.median(per_token),
                         "min": min(per_token), "max": max(per_token)})  # fmt: skip
        return rows
    finally:
        server.terminate()
        server.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=lambda s: [int(v) for v in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=16.0, help="how often every stream gets a token")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.step_ms / 1000)
        return
    rows = measure(args)
    print(f"bare Quart + Hypercorn, {os.cpu_count()} CPUs, {args.tokens} tokens per stream, a step every "
          f"{args.step_ms:g} ms, median of {args.rounds} rounds")  # fmt: skip
    print("| streams | app CPU us per streamed token (min-max) |\n|---|---|")
    for row in rows:
        print(f"| {row['streams']} | {row['us_per_token']:.1f} ({row['min']:.1f}-{row['max']:.1f}) |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
