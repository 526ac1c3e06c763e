"""The shared wire package: round trips of every message, typed leaves, refusal of bad frames, and
the import rule (the wire package imports neither process, nor torch or Quart)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import subprocess
import sys

import msgpack
import pytest

from tests.harness import REPO_ROOT
from wire import messages as wire
from wire.codec import MAX_FRAME_BYTES, ProtocolError, as_dict, from_plain, to_plain
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
from wire.stats import DeviceInfo, EngineInfo, EngineStats, TokenizerInfo, WorkerLoad

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
    wire.Load(3),
    wire.Unload(1.5, 3),
    wire.Reintroduce(),
    wire.Hello(wire.PROTOCOL_VERSION, "w#0", 1234),
    wire.Status(WorkerState.LOADING, "weights", 0.5),
    wire.Status(WorkerState.UNLOADED, "standby", None, 2),
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
    wire.Heartbeat(WorkerState.READY, EngineStats(), WorkerLoad(0, 0, 4, 2, 0, idle_s=12.5)),
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
    with pytest.raises(ProtocolError, match="at most length 8"):
        from_plain(Usage, [3, 1, 0, 0.0, 0.0, 0.0, 0, 0, 99])
    with pytest.raises(ProtocolError, match="at least length 2"):
        from_plain(Usage, [3])


def test_frames_keep_the_layout_of_protocol_version_3() -> None:
    """[tag, [field, ...]] with nested structs as arrays: a frame written field by field with plain
    msgpack (as the previous codec wrote it) decodes to the same message, and back."""
    output = ["r", "Hi", [5, 6], "stop", [3, 2, 0, 0.5, 0.0, 0.0, 0, 0], None, None]
    message = wire.decode(msgpack.packb(["step", [[output]]]))
    assert message == wire.Step([JobOutput("r", "Hi", [5, 6], FinishReason.STOP, Usage(3, 2, queue_s=0.5))])
    assert msgpack.unpackb(wire.encode(message)) == ["step", [[output]]]
    # An older worker's Hello still reads as one, so the gateway can refuse its version by name.
    assert wire.decode(msgpack.packb(["hello", [2, "old#0", 7]])) == wire.Hello(2, "old#0", 7)


def test_worker_spec_travels_as_json_on_the_command_line() -> None:
    spec = WorkerSpec("m", "transformers", "/models/m", 2048, {"threads": 1, "nested": {"a": [1.5]}})
    assert WorkerSpec(**json.loads(json.dumps(dataclasses.asdict(spec)))) == spec


def test_as_dict_names_every_field_down_to_the_leaves() -> None:
    device = {"index": 0, "visible_as": "cpu", "name": "cpu", "uuid": "", "memory_used_mib": 0,
              "memory_total_mib": 0}  # fmt: skip
    assert as_dict(INFO)["devices"] == [device]
    assert as_dict(EngineStats(steps=3))["steps"] == 3


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (["cancel", [5]], r"Cancel\.rid: Expected `str`, got `int`"),
        (["acc", ["r", True]], r"Accepted\.prompt_tokens: Expected `int`, got `bool`"),
        (["acc", ["r", -1]], r"Accepted\.prompt_tokens: Expected `int` >= 0"),
        (["gen", ["r", None, None, None, to_plain(SamplingParams())]], "exactly one"),
        (
            ["gen", ["r", "p", None, None, [256, float("nan")]]],
            r"Generate\.params\.temperature: Expected a finite number",
        ),
        (["gen", ["r", "p", None, None, [256, 1.0, 1.0, 0, 0.0, 1.0, float("inf")]]], "repetition_penalty"),
        (
            ["gen", ["r", "p", None, None, [256, 1.0, 1.0, 0, 0.0, 1.0, 1.0, 0.0, 0.0, None, [1]]]],
            r"Generate\.params\.stop\[0\]: Expected `str`, got `int`",
        ),
        (["gen", ["r", None, None, [["user", "hi", None, [["c", "f"]]]], [1]]], r"messages\[0\]\.tool_calls"),
        (["status", ["booting", "", None]], r"Status\.state: Invalid enum value 'booting'"),
        (["rej", ["r", "made_up_code", "m", None]], r"Rejected\.code: Invalid enum value"),
        (["hb", ["ready", [-1]]], r"Heartbeat\.stats\.active_jobs: Expected `int` >= 0"),
        (["hb", ["ready", ["x"]]], r"Heartbeat\.stats\.active_jobs: Expected `int`, got `str`"),
        (["hb", ["ready", [0, 0, 0, 0, 0, 0, 0.0, 1.5]]], r"kv_cache_usage_ratio: Expected `float` <= 1\.0"),
        (["hb", ["ready", [0, 0, 0, 0, 0, 0, 0.0, 0.5, 1, 2]]], "more free cache pages than pages"),
        (["step", [[["r", "t", [1], "maybe"]]]], r"Step\.outputs\[0\]\.finish_reason: Invalid enum value"),
        (["step", [[["r", "t", [True]]]]], r"Step\.outputs\[0\]\.token_ids\[0\]: Expected `int`, got `bool`"),
        (["step", [[["r", "t"]]]], "at least length 3"),
        (
            ["embs", ["e", [[0.5, float("nan")]], 2]],
            r"Embeddings\.vectors\[0\]\[1\]: Expected a finite number",
        ),
        (
            ["tok", ["t", None, None, True, [[["f", None, {"a": {"b": float("inf")}}]]]]],
            "parameters: not finite",
        ),
        (["tok", ["t", None, None, True, [[], True, False, {"k": {1: "x"}}]]], "template_kwargs: map keys"),
        (["nope", []], "unknown message tag"),
        ({"tag": "gen"}, r"not \[tag, fields\]"),
        (["cancel"], r"not \[tag, fields\]"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(raw: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        wire.decode(msgpack.packb(raw))


def test_deeply_nested_data_is_refused() -> None:
    deep: object = "x"
    for _ in range(40):
        deep = {"a": deep}
    with pytest.raises(ProtocolError, match="nested too deeply"):
        wire.decode(msgpack.packb(["tok", ["t", None, None, True, [[], True, False, {"k": deep}]]]))
    very_deep = b"\x91" * 100_000 + b"\x01"  # an array in an array ... 100,000 deep
    with pytest.raises(ProtocolError):
        wire.decode(b"\x92\xa6cancel\x91" + very_deep)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1garbage",
        msgpack.packb(["cancel", [msgpack.ExtType(1, b"x")]]),
        msgpack.packb(["tok", ["t", None, None, True, [[], True, False, {"k": msgpack.ExtType(1, b"x")}]]]),
        msgpack.packb(["cancel", ["r"]]) + b"trailing",
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
        "import sys, wire.messages, wire.states, wire.log_format, wire.yaml_file; "
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


def test_load_and_unload_are_validated_strictly() -> None:
    """A standby period is a count: a negative or missing one is refused, not taken as period 0."""
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb(["load", [-1]]))
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb(["load", []]))
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb(["unload", [float("nan"), 1]]))
    with pytest.raises(ProtocolError):
        wire.decode(msgpack.packb(["load", [1, 2]]))
    # A Status without the period (any state but unloaded) reads as before.
    assert wire.decode(msgpack.packb(["status", ["ready", "", None]])) == wire.Status(
        WorkerState.READY, "", None
    )
