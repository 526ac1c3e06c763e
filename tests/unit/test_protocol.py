"""Wire protocol: round trips of every message, and refusal of bad, oversized and pickled frames."""

from __future__ import annotations

import pickle

import msgpack
import pytest

from model_worker import protocol as wire

MESSAGES = [
    wire.Generate(
        "r1", "hello", None, None, wire.SamplingParams(stop=["\n"], logit_bias={5: -1.0}).to_wire()
    ),
    wire.Generate("r2", None, [1, 2, 3], None, {}),
    wire.Generate("r3", None, None, [{"role": "user", "content": "hi"}], {"max_tokens": 4}),
    wire.Cancel("r1"),
    wire.Shutdown(2.5),
    wire.Hello(wire.PROTOCOL_VERSION, "w#0", 1234),
    wire.Status("loading", "weights", 0.5),
    wire.Ready({"engine": "transformers", "max_seq_len": 2048, "devices": [{"name": "cpu"}]}),
    wire.Accepted("r1", 17),
    wire.Rejected("r1", "context_length_exceeded", "too long", "messages"),
    wire.Step(
        [
            wire.JobOutput("r1", "Hi", [5, 6], None, None),
            wire.JobOutput(
                "r2", "", [7], "stop", {"prompt_tokens": 3, "completion_tokens": 1}, [[-0.1, [[7, -0.1]]]]
            ),
        ]
    ),
    wire.Heartbeat({"active_jobs": 2, "queued_jobs": 0}),
    wire.Fatal("CUDA error"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: wire.Message) -> None:
    assert wire.decode(wire.encode(message)) == message


def test_sampling_params_round_trip_and_defaults() -> None:
    params = wire.SamplingParams(max_tokens=7, temperature=0.0, seed=3, stop=["x"], logprobs=2)
    assert wire.SamplingParams.from_wire(params.to_wire()) == params
    assert wire.SamplingParams.from_wire({}) == wire.SamplingParams()


@pytest.mark.parametrize(
    "raw",
    [
        {"max_tokens": "7"},
        {"unknown": 1},
        {"stop": [1]},
        {"temperature": float("nan")},
        {"logit_bias": {"a": 1}},
        {"ignore_eos": 1},
        [],
    ],
)
def test_sampling_params_rejects_bad_values(raw: object) -> None:
    with pytest.raises(wire.ProtocolError):
        wire.SamplingParams.from_wire(raw)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        msgpack.packb({"tag": "gen"}),
        msgpack.packb(["nope", []]),
        msgpack.packb(["cancel", []]),
        msgpack.packb(["cancel", [5]]),
        msgpack.packb(["acc", ["r", True]]),
        msgpack.packb(["step", [[["r", "t"]]]]),
        msgpack.packb(["cancel", [msgpack.ExtType(1, b"x")]]),
        pickle.dumps(wire.Cancel("r1")),
        pickle.dumps({"t": "cancel"}),
    ],
)
def test_bad_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(wire.ProtocolError):
        wire.decode(frame)


def test_oversized_frame_is_refused_before_parsing() -> None:
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        wire.decode(b"\x00" * (wire.MAX_FRAME_BYTES + 1))
