"""The shared wire package: round trips of every message, typed leaves, refusal of bad frames, and
the import rule (the wire package imports neither process, nor torch or Quart)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import msgpack
import pytest

from tests.harness import REPO_ROOT
from wire import messages as wire
from wire.codec import MAX_FRAME_BYTES, ProtocolError, from_plain, to_plain
from wire.params import ChatMessage, ChatOptions, SamplingParams, ToolCall, ToolSpec, WorkerSpec
from wire.results import (
    AbortReason,
    FinishReason,
    JobOutput,
    RejectCode,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from wire.states import WorkerState
from wire.stats import DeviceInfo, EngineInfo, EngineStats, TokenizerInfo

INFO = EngineInfo("transformers", "5.0", 2048, 8, 512, 32000, False, [DeviceInfo(0, "cpu", "cpu")])
MESSAGES = [
    wire.Generate("r1", "hello", None, None, SamplingParams(stop=["\n"], logit_bias={5: -1.0})),
    wire.Generate("r2", None, [1, 2, 3], None, SamplingParams()),
    wire.Generate("r3", None, None, [ChatMessage("user", "hi", "bob")], SamplingParams(max_tokens=4)),
    wire.Generate(
        "r4",
        None,
        None,
        [
            ChatMessage("assistant", "", None, [ToolCall("c1", "f", '{"a": 1}')]),
            ChatMessage("tool", "2", None, [], "c1"),
        ],
        SamplingParams(regex="(a|b)", prompt_logprobs=2, banned_strings=["x"], allowed_token_ids=[1, 2]),
        ChatOptions([ToolSpec("f", None, {"type": "object"})], False, True, {"enable_thinking": False}),
    ),
    wire.Cancel("r1"),
    wire.Tokenize("t1", None, [ChatMessage("user", "hi")], True),
    wire.Embed("e1", ["a", "b"], None),
    wire.Embed("e2", None, [[1, 2], [3]]),
    wire.Embeddings("e1", [[0.5, -0.25], [1.0, 0.0]], 4),
    wire.Detokenize("t2", [1, 2]),
    wire.Shutdown(2.5),
    wire.Reintroduce(),
    wire.Hello(wire.PROTOCOL_VERSION, "w#0", 1234),
    wire.Status(WorkerState.LOADING, "weights", 0.5),
    wire.Ready(INFO, 99, 1.5, 0.25, True),
    wire.Ready(
        INFO,
        99,
        1.5,
        0.25,
        True,
        TokenizerInfo("PreTrainedTokenizerFast", "<s>", "</s>", None, None, "x", 2048),
    ),
    wire.Accepted("r1", 17),
    wire.Rejected("r1", RejectCode.CONTEXT_LENGTH_EXCEEDED, "too long", "messages"),
    wire.Tokens("t1", [4, 5], ""),
    wire.Step(
        [
            JobOutput("r1", "Hi", [5, 6]),
            JobOutput(
                "r2",
                "x",
                [7],
                FinishReason.STOP,
                Usage(3, 1, queue_s=0.5),
                [TokenLogprob("x", 7, -0.1, [TopLogprob("x", 7, -0.1), TopLogprob("y", 8, -2.5)])],
                [TokenLogprob("<s>", 1, None, []), TokenLogprob("a", 9, -3.0, [TopLogprob("b", 4, -1.0)], 2)],
            ),
        ]
    ),  # fmt: skip
    wire.JobsAborted(["r1", "r2"], AbortReason.SHUTDOWN, "the server is shutting down"),
    wire.Heartbeat(WorkerState.READY, EngineStats(active_jobs=2, gpu_memory_used_bytes={"0": 1 << 30})),
    wire.Fatal("CUDA error"),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(message: wire.Message) -> None:
    decoded = wire.decode(wire.encode(message))
    assert decoded == message and type(decoded) is type(message)


def test_leaves_decode_to_their_types() -> None:
    step = wire.decode(wire.encode(next(m for m in MESSAGES if isinstance(m, wire.Step))))
    assert isinstance(step, wire.Step)
    last = step.outputs[1]
    assert last.finish_reason is FinishReason.STOP and isinstance(last.usage, Usage)
    assert last.logprobs is not None and isinstance(last.logprobs[0].top[1], TopLogprob)
    assert last.prompt_logprobs is not None and last.prompt_logprobs[0].logprob is None
    assert last.prompt_logprobs[1].rank == 2
    status = wire.decode(wire.encode(wire.Status(WorkerState.WARMING, "", None)))
    assert isinstance(status, wire.Status) and status.state is WorkerState.WARMING


def test_trailing_defaults_may_be_left_out_but_extra_fields_never_pass() -> None:
    assert from_plain(Usage, [3, 1]) == Usage(3, 1)
    with pytest.raises(ProtocolError, match="fields"):
        from_plain(Usage, [3, 1, 0, 0.0, 0.0, 0.0, 0, 0, 99])
    with pytest.raises(ProtocolError, match="fields"):
        from_plain(Usage, [3])


def test_worker_spec_round_trip() -> None:
    spec = WorkerSpec("m", "transformers", "/models/m", 2048, {"threads": 1, "nested": {"a": [1.5]}})
    assert from_plain(WorkerSpec, to_plain(spec)) == spec


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (["cancel", [5]], "str expected"),
        (["acc", ["r", True]], "int expected"),
        (["gen", ["r", None, None, None, to_plain(SamplingParams())]], "exactly one"),
        (["gen", ["r", "p", None, None, [256, float("nan")]]], "not finite"),
        (
            ["gen", ["r", "p", None, None, [256, 1.0, 1.0, 0, 0.0, 1.0, 1.0, 0.0, 0.0, None, [1]]]],
            "str expected",
        ),
        (["status", ["booting", "", None]], "not a WorkerState"),
        (["rej", ["r", "made_up_code", "m", None]], "not a RejectCode"),
        (["hb", ["ready", [-1]]], "negative"),
        (["hb", ["ready", ["x"]]], "int expected"),
        (["hb", ["ready", [0, 0, 0, 0, 0, 0, 0.0, 1.5]]], "within"),
        (["step", [[["r", "t", [1], "maybe"]]]], "not a FinishReason"),
        (["step", [[["r", "t", [True]]]]], "int expected"),
        (["step", [[["r", "t"]]]], "fields"),
        (["nope", []], "unknown message tag"),
        ({"tag": "gen"}, "not \\[tag, fields\\]"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(raw: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(msgpack.packb(raw))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        msgpack.packb(["cancel", [msgpack.ExtType(1, b"x")]]),
        pickle.dumps(wire.Cancel("r1")),
        pickle.dumps({"t": "cancel"}),
    ],
)
def test_bad_frames_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.decode(frame)


def test_oversized_frame_is_refused_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode(b"\x00" * (MAX_FRAME_BYTES + 1))


def test_wire_package_imports_neither_process_nor_heavy_libraries() -> None:
    code = (
        "import sys, wire.messages, wire.states, wire.log_format; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('gateway', 'model_worker', 'torch', 'quart', 'pydantic', 'zmq')]; print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True
    )
    assert out.stdout.strip() == "[]"


def test_the_two_processes_never_import_each_other() -> None:
    """The gateway never imports the worker package and the worker never imports the gateway's."""
    code = (
        "import sys, importlib, pkgutil, {pkg}; "
        "[importlib.import_module(m.name) for m in pkgutil.walk_packages({pkg}.__path__, '{pkg}.') "
        " if not m.name.endswith(('.engine', '__main__'))]; "
        "print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'{other}'}}))"
    )
    for package, other in (("gateway", "model_worker"), ("model_worker", "gateway")):
        out = subprocess.run(
            [sys.executable, "-c", code.format(pkg=package, other=other)],
            capture_output=True, text=True, cwd=REPO_ROOT, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == "[]", f"{package} imports {other}"
