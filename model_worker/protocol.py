"""Wire messages between the gateway and its model workers.

Imported by both processes. The gateway imports it without torch, so this module depends on the
standard library and msgpack only. It owns the message schema, the protocol version and the frame
codec: every frame is `msgpack([tag, [field, ...]])`, validated field by field on decode. Nothing
here ever unpickles; a frame that is oversized, malformed or of the wrong shape raises
`ProtocolError`, and the receiver logs and drops it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1
# A Step carries one entry per active job; even at batch 256 with logprobs it stays far below this.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# The socket-level cap (ZMQ_MAXMSGSIZE) sits above the protocol's: ZeroMQ answers a violation by
# closing the connection for good, so frames between the two caps are dropped and logged instead,
# and only an absurd frame costs the link (the heartbeat watchdog then restarts the worker).
MAX_SOCKET_MESSAGE_BYTES = 4 * MAX_FRAME_BYTES


class ProtocolError(ValueError):
    """A frame that does not decode to a valid message of this protocol version."""


# Allowed Python types per field, checked on decode. `None` in a tuple means the field is optional.
_Spec = dict[str, tuple[Any, ...]]


def _check_fields(cls_name: str, spec: _Spec, values: list[Any]) -> None:
    if len(values) != len(spec):
        raise ProtocolError(f"{cls_name}: expected {len(spec)} fields, got {len(values)}")
    for (name, allowed), value in zip(spec.items(), values, strict=True):
        if value is None and None in allowed:
            continue
        kinds = tuple(t for t in allowed if t is not None)
        # bool is an int subclass; a bool must not pass where a number is meant and vice versa.
        if isinstance(value, bool) and bool not in kinds:
            raise ProtocolError(f"{cls_name}.{name}: bool not allowed")
        if not isinstance(value, kinds):
            raise ProtocolError(f"{cls_name}.{name}: {type(value).__name__} not allowed")


# ---------------------------------------------------------------------------------------------
# Request parameters (gateway -> worker), carried inside Generate.


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Everything the engine needs to run one job; already validated and normalized at the API edge."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # None: no logprobs. 0: logprob of the chosen token only. k > 0: also the top k alternatives.
    logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: json_object asks for any JSON object; json_schema (JSON text) for one
    # matching that schema. Engines enforce it by constrained decoding.
    json_object: bool = False
    json_schema: str | None = None

    _SPEC: ClassVar[_Spec] = {
        "max_tokens": (int,),
        "temperature": (float, int),
        "top_p": (float, int),
        "top_k": (int,),
        "min_p": (float, int),
        "typical_p": (float, int),
        "repetition_penalty": (float, int),
        "frequency_penalty": (float, int),
        "presence_penalty": (float, int),
        "seed": (int, None),
        "stop": (list,),
        "stop_token_ids": (list,),
        "ignore_eos": (bool,),
        "min_tokens": (int,),
        "logprobs": (int, None),
        "logit_bias": (dict,),
        "json_object": (bool,),
        "json_schema": (str, None),
    }

    def to_wire(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_wire(cls, raw: Any) -> SamplingParams:
        if not isinstance(raw, dict):
            raise ProtocolError("params: expected a map")
        unknown = set(raw) - set(cls._SPEC)
        if unknown:
            raise ProtocolError(f"params: unknown keys {sorted(unknown)}")
        merged = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
        merged.update(raw)
        _check_fields("params", cls._SPEC, [merged[name] for name in cls._SPEC])
        if not all(isinstance(s, str) for s in merged["stop"]):
            raise ProtocolError("params.stop: strings expected")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in merged["stop_token_ids"]):
            raise ProtocolError("params.stop_token_ids: ints expected")
        bias = merged["logit_bias"]
        if not all(isinstance(k, int) and isinstance(v, (int, float)) for k, v in bias.items()):
            raise ProtocolError("params.logit_bias: int -> number expected")
        for name in ("temperature", "top_p", "min_p", "typical_p", "repetition_penalty"):
            if not math.isfinite(merged[name]):
                raise ProtocolError(f"params.{name}: not finite")
        return cls(**merged)


# ---------------------------------------------------------------------------------------------
# Messages. Each has a short tag and a field spec; order of the spec is the order on the wire.


class Message:
    TAG: ClassVar[str]
    SPEC: ClassVar[_Spec]

    def fields(self) -> list[Any]:
        return [getattr(self, name) for name in self.SPEC]


@dataclass(frozen=True, slots=True)
class Generate(Message):
    """Start one job. Exactly one of prompt, prompt_token_ids, messages is set."""

    rid: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    messages: list[dict[str, Any]] | None
    params: dict[str, Any]
    TAG: ClassVar[str] = "gen"
    SPEC: ClassVar[_Spec] = {
        "rid": (str,),
        "prompt": (str, None),
        "prompt_token_ids": (list, None),
        "messages": (list, None),
        "params": (dict,),
    }


@dataclass(frozen=True, slots=True)
class Tokenize(Message):
    """Tokenize a prompt, or chat messages rendered with the model's template; answered by Tokens."""

    rid: str
    prompt: str | None
    messages: list[dict[str, Any]] | None
    add_special_tokens: bool
    TAG: ClassVar[str] = "tok"
    SPEC: ClassVar[_Spec] = {
        "rid": (str,),
        "prompt": (str, None),
        "messages": (list, None),
        "add_special_tokens": (bool,),
    }


@dataclass(frozen=True, slots=True)
class Detokenize(Message):
    rid: str
    token_ids: list[int]
    TAG: ClassVar[str] = "detok"
    SPEC: ClassVar[_Spec] = {"rid": (str,), "token_ids": (list,)}


@dataclass(frozen=True, slots=True)
class Tokens(Message):
    """The answer to Tokenize or Detokenize: the ids and the text they stand for."""

    rid: str
    token_ids: list[int]
    text: str
    TAG: ClassVar[str] = "toks"
    SPEC: ClassVar[_Spec] = {"rid": (str,), "token_ids": (list,), "text": (str,)}


@dataclass(frozen=True, slots=True)
class Cancel(Message):
    rid: str
    TAG: ClassVar[str] = "cancel"
    SPEC: ClassVar[_Spec] = {"rid": (str,)}


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    """Stop accepting jobs, cancel what is left after `grace_s`, then exit."""

    grace_s: float
    TAG: ClassVar[str] = "shutdown"
    SPEC: ClassVar[_Spec] = {"grace_s": (float, int)}


@dataclass(frozen=True, slots=True)
class Reintroduce(Message):
    """The gateway does not know this worker (it restarted): send Hello, and Ready if ready."""

    TAG: ClassVar[str] = "reintro"
    SPEC: ClassVar[_Spec] = {}


@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First frame from a worker: who it is and which protocol it speaks."""

    version: int
    worker_id: str
    pid: int
    TAG: ClassVar[str] = "hello"
    SPEC: ClassVar[_Spec] = {"version": (int,), "worker_id": (str,), "pid": (int,)}


@dataclass(frozen=True, slots=True)
class Status(Message):
    """Lifecycle progress before ready: state is loading or warming; progress in [0, 1] or None."""

    state: str
    detail: str
    progress: float | None
    TAG: ClassVar[str] = "status"
    SPEC: ClassVar[_Spec] = {"state": (str,), "detail": (str,), "progress": (float, int, None)}


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """Model loaded and warmed up. info: engine, max_seq_len, devices, limits, warm-up timings."""

    info: dict[str, Any]
    TAG: ClassVar[str] = "ready"
    SPEC: ClassVar[_Spec] = {"info": (dict,)}


@dataclass(frozen=True, slots=True)
class Accepted(Message):
    rid: str
    prompt_tokens: int
    TAG: ClassVar[str] = "acc"
    SPEC: ClassVar[_Spec] = {"rid": (str,), "prompt_tokens": (int,)}


@dataclass(frozen=True, slots=True)
class Rejected(Message):
    """The job was refused before it started; code is an OpenAI-style error code."""

    rid: str
    code: str
    message: str
    param: str | None
    TAG: ClassVar[str] = "rej"
    SPEC: ClassVar[_Spec] = {"rid": (str,), "code": (str,), "message": (str,), "param": (str, None)}


@dataclass(frozen=True, slots=True)
class JobOutput:
    """One job's progress in one generator step. usage is set on the last output of a job.

    logprobs, when asked for, is a list with one entry per token in token_ids:
    [token_logprob, [[token_id, logprob], ...top alternatives]].
    """

    rid: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, Any] | None
    logprobs: list[Any] | None = None
    SPEC: ClassVar[_Spec] = {
        "rid": (str,),
        "text": (str,),
        "token_ids": (list,),
        "finish_reason": (str, None),
        "usage": (dict, None),
        "logprobs": (list, None),
    }

    def fields(self) -> list[Any]:
        return [self.rid, self.text, self.token_ids, self.finish_reason, self.usage, self.logprobs]


@dataclass(frozen=True, slots=True)
class Step(Message):
    """Every active job's new output from one generator step, in one frame."""

    outputs: list[JobOutput]
    TAG: ClassVar[str] = "step"
    SPEC: ClassVar[_Spec] = {"outputs": (list,)}

    def fields(self) -> list[Any]:
        return [[o.fields() for o in self.outputs]]


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    """Liveness and load figures: active_jobs, queued_jobs, steps, tokens, device memory, ..."""

    stats: dict[str, Any]
    TAG: ClassVar[str] = "hb"
    SPEC: ClassVar[_Spec] = {"stats": (dict,)}


@dataclass(frozen=True, slots=True)
class Fatal(Message):
    """The worker hit an unrecoverable error and is about to exit."""

    message: str
    TAG: ClassVar[str] = "fatal"
    SPEC: ClassVar[_Spec] = {"message": (str,)}


_MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TAG: cls
    for cls in (
        Generate, Tokenize, Detokenize, Cancel, Shutdown, Reintroduce,
        Hello, Status, Ready, Accepted, Rejected, Tokens, Step, Heartbeat, Fatal,
    )
}  # fmt: skip


def encode(message: Message) -> bytes:
    return msgpack.packb([message.TAG, message.fields()], use_bin_type=True)


def _decode_step(values: list[Any]) -> Step:
    outputs = []
    for raw in values[0]:
        if not isinstance(raw, list):
            raise ProtocolError("Step.outputs: entries must be arrays")
        _check_fields("JobOutput", JobOutput.SPEC, raw)
        outputs.append(JobOutput(*raw))
    return Step(outputs)


def decode(frame: bytes) -> Message:
    """Decode and validate one frame. Raises ProtocolError for anything unexpected."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        # ext types are refused outright: they are how foreign object encodings sneak in.
        raw = msgpack.unpackb(frame, raw=False, strict_map_key=False, ext_hook=_refuse_ext)
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for corrupt input
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}") from None
    if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str) and isinstance(raw[1], list)):
        raise ProtocolError("frame is not [tag, fields]")
    tag, values = raw
    cls = _MESSAGE_TYPES.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown message tag {tag!r}")
    _check_fields(cls.__name__, cls.SPEC, values)
    if cls is Step:
        return _decode_step(values)
    return cls(*values)


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} not allowed")
