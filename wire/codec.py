"""The frame codec: msgspec Structs as msgpack arrays, validated in C on decode.

Imported by the gateway and by every worker. Owns the frame format, its limits and the struct base
every wire type derives from. A message and each nested struct is a `Struct`: frozen, encoded as an
array of its fields in declaration order (`array_like`), never tracked by the garbage collector
(`gc=False`: wire structs hold plain data and never form reference cycles). msgspec checks every
field's type while it decodes, so no field is described twice and nothing here walks a frame in
Python. A frame is `msgpack([tag, [field, ...]])`: the tag picks the message type, whose own decoder
reads the fields; nested structs are arrays too, enums travel as their values, and trailing fields
that have defaults may be left out (msgspec writes every field of an array-like struct whatever
`omit_defaults` says, msgspec#720, so that option is not set). This is the layout protocol version
3 had, so frames of either codec decode alike.

Nothing here unpickles: msgpack ext types are refused, and anything oversized, malformed, of the
wrong shape or with a value outside its constraints (non-finite floats, negative counts) raises
`ProtocolError` naming the field.
"""

from __future__ import annotations

import math
import sys
import types
import typing
from typing import Annotated, Any, ClassVar, TypeVar, Union

import msgspec

# A Step carries one entry per active job; even at batch 256 with logprobs it stays far below this.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# The socket-level cap (ZMQ_MAXMSGSIZE) sits above the protocol's: ZeroMQ answers a violation by
# closing the connection for good, so frames between the two caps are dropped and logged instead,
# and only an absurd frame costs the link (the heartbeat watchdog then restarts the worker).
MAX_SOCKET_MESSAGE_BYTES = 4 * MAX_FRAME_BYTES
# Free-form fields (a tool's JSON schema, template variables) nest no deeper than this.
MAX_PLAIN_DEPTH = 32

# Field types with constraints msgspec checks while decoding (construction in code is not checked).
Finite = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=sys.float_info.max)]  # no nan, no inf
Count = Annotated[int, msgspec.Meta(ge=0)]
PromptCut = Annotated[int, msgspec.Meta(ge=1)]  # tokens of a prompt to keep, from its end


class ProtocolError(ValueError):
    """A frame that does not decode to a valid message of this protocol version."""


class Struct(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, gc=False):
    """Base of every struct that travels in a frame. Subclasses say `frozen=True` again only for
    mypy, which does not carry it over from a base (msgspec does)."""


class Message(Struct, frozen=True):
    """Base of every top-level message; `TAG` names it on the wire."""

    TAG: ClassVar[str]


T = TypeVar("T")


def _refuse_ext(code: int, data: memoryview) -> Any:
    # ext types are how foreign object encodings sneak in; a plain-data protocol has no use for them.
    raise ValueError(f"msgpack ext type {code} not allowed")


def check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Free-form (`Any`) fields carry plain data only: maps with string keys, arrays, finite
    numbers, strings, booleans and null, nested at most MAX_PLAIN_DEPTH deep. Called from the
    `__post_init__` of the structs that have such fields; raises ValueError."""
    if depth > MAX_PLAIN_DEPTH:
        raise ValueError(f"{where}: nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where}: not finite")
        return
    if isinstance(value, list):
        for item in value:
            check_plain(item, where, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{where}: map keys must be strings")
            check_plain(item, where, depth + 1)
        return
    raise ValueError(f"{where}: {type(value).__name__} not allowed")


def _field_path(cls: type, path: str) -> str:
    """msgspec names a bad value by its position (`$[4][0]`); say which field that is instead
    (`Generate.params.max_tokens`), following the struct types the indices run through."""
    names = [cls.__name__]
    hint: Any = cls
    for index in (int(part) for part in path.strip("$[]").split("][") if part.isdigit()):
        hint = _bare(hint)
        if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
            fields = msgspec.structs.fields(hint)
            if index >= len(fields):
                break
            names.append(fields[index].name)
            hint = fields[index].type
        elif typing.get_origin(hint) is list:
            names[-1] += f"[{index}]"
            hint = typing.get_args(hint)[0]
        else:
            break
    return ".".join(names)


def _bare(hint: Any) -> Any:
    """`X` of `X | None` and of `Annotated[X, ...]`."""
    while True:
        origin = typing.get_origin(hint)
        if origin is Annotated:
            hint = typing.get_args(hint)[0]
            continue
        if origin in (Union, types.UnionType):
            options = [a for a in typing.get_args(hint) if a is not type(None)]
            if len(options) == 1:
                hint = options[0]
                continue
        return hint


# What msgspec says of a value outside `Finite` (nan and inf included), and what it means.
_NOT_FINITE = (f"Expected `float` >= {-sys.float_info.max!r}", f"Expected `float` <= {sys.float_info.max!r}")


def _protocol_error(cls: type, exc: Exception) -> ProtocolError:
    text = str(exc)
    for phrase in _NOT_FINITE:
        text = text.replace(phrase, "Expected a finite number")
    head, _, path = text.rpartition(" - at `")
    if head and path.endswith("`"):
        where = path[:-1]
        return ProtocolError(f"{_field_path(cls, where.split('`')[-1])}: {head} ({where})")
    return ProtocolError(f"{cls.__name__}: {text}")


class _TypeCodec:
    """The decoder of one struct type (reused: msgspec decoders are built once and are cheap)."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(cls, ext_hook=_refuse_ext)

    def decode(self, data: bytes | msgspec.Raw) -> Any:
        try:
            return self.decoder.decode(data)
        except msgspec.ValidationError as exc:
            raise _protocol_error(self.cls, exc) from None
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:  # ValueError: ext, deep nesting
            raise ProtocolError(f"{self.cls.__name__}: {exc}") from None


_ENCODER = msgspec.msgpack.Encoder()
_CODECS: dict[type, _TypeCodec] = {}


def _codec(cls: type) -> _TypeCodec:
    codec = _CODECS.get(cls)
    if codec is None:
        codec = _CODECS[cls] = _TypeCodec(cls)
    return codec


def to_plain(obj: Any) -> Any:
    """A struct as the nested arrays it travels as (for tests and for embedding in other formats)."""
    return msgspec.to_builtins(obj)


def from_plain(cls: type[T], raw: Any) -> T:
    """The inverse of `to_plain`, validated; ProtocolError if `raw` does not fit `cls`."""
    return _codec(cls).decode(msgspec.msgpack.encode(raw))  # type: ignore[no-any-return]


def as_dict(obj: Any) -> Any:
    """A struct as nested dicts keyed by field name (for JSON reports and the admin API), like
    `dataclasses.asdict`; lists and dict values are converted too, everything else is kept."""
    if isinstance(obj, msgspec.Struct):
        return {name: as_dict(getattr(obj, name)) for name in obj.__struct_fields__}
    if isinstance(obj, list):
        return [as_dict(item) for item in obj]
    if isinstance(obj, dict):
        return {key: as_dict(item) for key, item in obj.items()}
    return obj


# ---- frames ------------------------------------------------------------------------------------

_FRAME = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw], ext_hook=_refuse_ext)


# What encoding a message can raise for a value its schema let through (an integer past 64 bits, a
# lone surrogate): the sender's caller turns it into a refusal of the request, never a crash.
ENCODE_ERRORS: tuple[type[Exception], ...] = (
    OverflowError,
    UnicodeEncodeError,
    ValueError,
    msgspec.EncodeError,
)


class Codec:
    """Encodes and decodes the frames of one set of message types (the protocol's)."""

    def __init__(self, message_types: list[type[Message]]) -> None:
        self.by_tag: dict[str, _TypeCodec] = {}
        for cls in message_types:
            if cls.TAG in self.by_tag:
                raise TypeError(f"duplicate message tag {cls.TAG!r}")
            self.by_tag[cls.TAG] = _codec(cls)

    def encode(self, message: Message) -> bytes:
        return _ENCODER.encode((message.TAG, message))

    def decode(self, frame: bytes) -> Message:
        """Decode and validate one frame. Raises ProtocolError for anything unexpected."""
        if len(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            tag, fields = _FRAME.decode(frame)
        except msgspec.ValidationError:
            raise ProtocolError("frame is not [tag, fields]") from None
        except (msgspec.DecodeError, ValueError, RecursionError) as exc:
            raise ProtocolError(f"undecodable frame: {exc}") from None
        codec = self.by_tag.get(tag)
        if codec is None:
            raise ProtocolError(f"unknown message tag {tag!r}")
        return codec.decode(fields)  # type: ignore[no-any-return]
