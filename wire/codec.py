"""The frame codec: typed dataclasses to msgpack arrays and back, validated field by field.

Imported by the gateway and by every worker. Owns the frame format and its limits. Each message
and nested struct is a frozen dataclass declared once; the codec reads its type hints and compiles
an encoder and a validating decoder per class, so no field is described twice and decoding a Step
of 64 jobs costs a few closure calls per field. A frame is `msgpack([tag, [field, ...]])`; nested
structs are arrays too, enums travel as their values. Nothing here unpickles: msgpack ext types
are refused, and anything oversized, malformed or of the wrong shape raises `ProtocolError`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, Union

import msgpack

# A Step carries one entry per active job; even at batch 256 with logprobs it stays far below this.
MAX_FRAME_BYTES = 16 * 1024 * 1024
# The socket-level cap (ZMQ_MAXMSGSIZE) sits above the protocol's: ZeroMQ answers a violation by
# closing the connection for good, so frames between the two caps are dropped and logged instead,
# and only an absurd frame costs the link (the heartbeat watchdog then restarts the worker).
MAX_SOCKET_MESSAGE_BYTES = 4 * MAX_FRAME_BYTES


class ProtocolError(ValueError):
    """A frame that does not decode to a valid message of this protocol version."""


class Message:
    """Base of every top-level message; `TAG` names it on the wire."""

    TAG: ClassVar[str]


T = TypeVar("T")
Decoder = Callable[[Any], Any]
Encoder = Callable[[Any], Any]


def _identity(value: Any) -> Any:
    return value


# ---- decoders ----------------------------------------------------------------------------------


def _scalar_decoder(kind: type, where: str) -> Decoder:
    if kind is float:

        def decode_float(value: Any) -> float:
            # bool is an int subclass: it must not pass where a number is meant, nor vice versa.
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ProtocolError(f"{where}: number expected, got {type(value).__name__}")
            number = float(value)
            if not math.isfinite(number):
                raise ProtocolError(f"{where}: not finite")
            return number

        return decode_float
    if kind is int:

        def decode_int(value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProtocolError(f"{where}: int expected, got {type(value).__name__}")
            return value

        return decode_int

    def decode_exact(value: Any) -> Any:
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ProtocolError(f"{where}: {kind.__name__} expected, got {type(value).__name__}")
        return value

    return decode_exact


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """`Any` fields carry plain msgpack data only (maps, arrays, scalars), and not too deeply."""
    if depth > 32:
        raise ProtocolError(f"{where}: nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ProtocolError(f"{where}: not finite")
        return value
    if isinstance(value, list):
        return [_plain(v, where, depth + 1) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise ProtocolError(f"{where}: map keys must be strings")
        return {k: _plain(v, where, depth + 1) for k, v in value.items()}
    raise ProtocolError(f"{where}: {type(value).__name__} not allowed")


def _decoder_for(hint: Any, where: str) -> Decoder:
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda value: _plain(value, where)
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{where}: only `X | None` unions are supported on the wire")
        inner = _decoder_for(options[0], where)
        return lambda value: None if value is None else inner(value)
    if origin is list:
        (item_hint,) = typing.get_args(hint)
        item = _decoder_for(item_hint, where + "[]")

        def decode_list(value: Any) -> list[Any]:
            if not isinstance(value, list):
                raise ProtocolError(f"{where}: array expected, got {type(value).__name__}")
            return [item(v) for v in value]

        return decode_list
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint)
        key = _decoder_for(key_hint, where + ".key")
        val = _decoder_for(value_hint, where + ".value")

        def decode_dict(value: Any) -> dict[Any, Any]:
            if not isinstance(value, dict):
                raise ProtocolError(f"{where}: map expected, got {type(value).__name__}")
            return {key(k): val(v) for k, v in value.items()}

        return decode_dict
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        enum_type = hint

        def decode_enum(value: Any) -> Any:
            try:
                return enum_type(value)
            except ValueError:
                raise ProtocolError(f"{where}: {value!r} is not a {enum_type.__name__}") from None

        return decode_enum
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return compiled(hint).decode_fields
    if hint in (int, float, str, bool):
        return _scalar_decoder(hint, where)
    raise TypeError(f"{where}: type {hint!r} cannot travel on the wire")


# ---- encoders ----------------------------------------------------------------------------------


def _encoder_for(hint: Any) -> Encoder:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        (inner_hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        inner = _encoder_for(inner_hint)
        if inner is _identity:
            return _identity
        return lambda value: None if value is None else inner(value)
    if origin is list:
        item = _encoder_for(typing.get_args(hint)[0])
        if item is _identity:
            return _identity
        return lambda value: [item(v) for v in value]
    if origin is dict:
        return _identity  # keys and values are scalars or plain data on every dict we send
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda value: value.value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return compiled(hint).encode_fields
    return _identity


# ---- per-class codecs --------------------------------------------------------------------------


class _Compiled:
    """Encoder and validating decoder of one dataclass, built on first use from its type hints."""

    def __init__(self, cls: type) -> None:
        self.cls = cls
        self.name = cls.__name__
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if f.init]
        self.names = [f.name for f in fields]
        self.required = sum(
            1 for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        self.decoders: list[Decoder] = []
        self.encoders: list[Encoder] = []
        # Registered before the fields are compiled, so a struct may nest itself.
        _COMPILED[cls] = self
        for f in fields:
            self.decoders.append(_decoder_for(hints[f.name], f"{self.name}.{f.name}"))
            self.encoders.append(_encoder_for(hints[f.name]))
        self.check: Callable[[Any], None] | None = getattr(cls, "check", None)

    def encode_fields(self, obj: Any) -> list[Any]:
        return [enc(getattr(obj, name)) for name, enc in zip(self.names, self.encoders, strict=True)]

    def decode_fields(self, raw: Any) -> Any:
        if not isinstance(raw, list):
            raise ProtocolError(f"{self.name}: array expected, got {type(raw).__name__}")
        # Trailing fields that have defaults may be left out; extra fields never pass.
        if not self.required <= len(raw) <= len(self.names):
            raise ProtocolError(f"{self.name}: expected {len(self.names)} fields, got {len(raw)}")
        values = [dec(v) for dec, v in zip(self.decoders, raw, strict=False)]
        try:
            obj = self.cls(*values)
        except (TypeError, ValueError) as exc:
            raise ProtocolError(f"{self.name}: {exc}") from None
        if self.check is not None:
            try:
                obj.check()
            except ValueError as exc:
                raise ProtocolError(f"{self.name}: {exc}") from None
        return obj


_COMPILED: dict[type, _Compiled] = {}


def compiled(cls: type) -> _Compiled:
    codec = _COMPILED.get(cls)
    return codec if codec is not None else _Compiled(cls)


def to_plain(obj: Any) -> list[Any]:
    """A struct as the nested arrays it travels as (for tests and for embedding in other formats)."""
    return compiled(type(obj)).encode_fields(obj)


def from_plain(cls: type[T], raw: Any) -> T:
    """The inverse of `to_plain`, validated; ProtocolError if `raw` does not fit `cls`."""
    return compiled(cls).decode_fields(raw)  # type: ignore[no-any-return]


# ---- frames ------------------------------------------------------------------------------------


class Codec:
    """Encodes and decodes the frames of one set of message types (the protocol's)."""

    def __init__(self, message_types: list[type[Message]]) -> None:
        self.by_tag: dict[str, _Compiled] = {}
        for cls in message_types:
            if cls.TAG in self.by_tag:
                raise TypeError(f"duplicate message tag {cls.TAG!r}")
            self.by_tag[cls.TAG] = compiled(cls)

    def encode(self, message: Message) -> bytes:
        fields = compiled(type(message)).encode_fields(message)
        return msgpack.packb([message.TAG, fields], use_bin_type=True)  # type: ignore[no-any-return]

    def decode(self, frame: bytes) -> Message:
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
        if not (isinstance(raw, list) and len(raw) == 2 and isinstance(raw[0], str)):
            raise ProtocolError("frame is not [tag, fields]")
        codec = self.by_tag.get(raw[0])
        if codec is None:
            raise ProtocolError(f"unknown message tag {raw[0]!r}")
        return codec.decode_fields(raw[1])  # type: ignore[no-any-return]


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(f"msgpack ext type {code} not allowed")
