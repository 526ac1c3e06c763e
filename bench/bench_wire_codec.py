"""The wire codec's cost on the hot frame: encoding and decoding one Step of 64 job outputs.

Runs as a standalone process on any host (no model, no sockets). Owns the frames it times: a Step
as a worker sends it every generator step at 64 concurrent streams, one token per job; the same
with a finished job's usage on 8 of them; and the same with `logprobs: 5` on every job. Each is
encoded with `wire.encode` and decoded with `wire.decode` (the gateway's reader decodes every
frame a worker sends), and, for scale, unpacked with plain `msgpack.unpackb` (no validation, no
types). Reports the median of `--repeats` timings of `--number` calls each, in microseconds.

    python bench/bench_wire_codec.py [--repeats 7] [--number 2000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import msgpack  # noqa: E402

from wire import messages as wire  # noqa: E402
from wire.results import FinishReason, JobOutput, TokenLogprob, TopLogprob, Usage  # noqa: E402

STREAMS = 64


def step_frame(kind: str) -> wire.Step:
    """The Step a worker sends at 64 streams: one new token per job, rids as the gateway makes them."""
    outputs = []
    for i in range(STREAMS):
        rid = f"cmpl-{i:08x}9f1c4e2a7b3d4c5e6f708192-0"
        token = 1000 + 37 * i
        finish, usage, logprobs = None, None, None
        if kind == "finishing" and i % 8 == 0:
            finish = FinishReason.LENGTH
            usage = Usage(92, 256, 0, 0.0012, 0.0451, 4.875)
        if kind == "logprobs":
            top = [TopLogprob(f" w{k}", token + k, -0.5 - k) for k in range(5)]
            logprobs = [TokenLogprob(" w0", token, -0.5, top)]
        outputs.append(JobOutput(rid, " word", [token], finish, usage, logprobs))
    return wire.Step(outputs)


def time_us(call: Any, repeats: int, number: int) -> float:
    return 1e6 * statistics.median(timeit.repeat(call, repeat=repeats, number=number)) / number


def measure(repeats: int, number: int) -> dict[str, Any]:
    rows = {}
    for kind in ("tokens", "finishing", "logprobs"):
        message = step_frame(kind)
        frame = wire.encode(message)
        assert wire.decode(frame) == message
        rows[kind] = {
            "bytes": len(frame),
            "encode_us": time_us(lambda m=message: wire.encode(m), repeats, number),
            "decode_us": time_us(lambda f=frame: wire.decode(f), repeats, number),
            "msgpack_unpackb_us": time_us(lambda f=frame: msgpack.unpackb(f), repeats, number),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    rows = measure(args.repeats, args.number)
    print(f"python {platform.python_version()}, {platform.processor() or platform.machine()}; "
          f"median of {args.repeats} x {args.number} calls")  # fmt: skip
    print(f"| Step of {STREAMS} outputs | bytes | encode µs | decode µs | plain msgpack.unpackb µs |")
    print("|---|---|---|---|---|")
    for kind, r in rows.items():
        print(f"| {kind} | {r['bytes']} | {r['encode_us']:.1f} | {r['decode_us']:.1f} "
              f"| {r['msgpack_unpackb_us']:.1f} |")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
