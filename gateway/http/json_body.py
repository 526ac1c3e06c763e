"""Request bodies parsed as JSON that the rest of the gateway can trust, or a 400 that says why.

Runs in the gateway process, on its asyncio loop: `JsonRequest` is the app's request class, so the
schema validation, the key check and the routes all read a body parsed here, and a client that
leaves as its body arrives cancels its request (see `JsonRequest.get_data`). Owns what JSON itself
allows but nothing downstream can handle, each refused as a 400 naming the place:
- bytes that are not UTF-8;
- nesting deeper than MAX_JSON_DEPTH (the parser would recurse until Python gives up);
- numbers past Python's digit limit (a ValueError deep in the parser);
- lone UTF-16 surrogates (`"\\ud800"` is valid JSON, but no UTF-8 encoder will pass it on, so the
  worker's frame could not be built).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, Literal, overload

from quart import Request
from werkzeug.exceptions import RequestTimeout

from gateway.errors import InvalidRequest

MAX_JSON_DEPTH = 64
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_NOT_A_BRACKET = re.compile(r"[^\[\]{}]+")


def parse_json_body(raw: bytes) -> Any:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH:
        _check_depth_cheaply(text)
    try:
        body = json.loads(text)
    except RecursionError:  # unreachable after the depth check, kept as the last line of defence
        raise InvalidRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):
        where = _lone_surrogate_at(body)
        if where is not None:
            raise InvalidRequest(f"{where}: contains a lone UTF-16 surrogate, which is not text", param=where)
    return body


def _check_depth_cheaply(text: str) -> None:
    """Refuse nesting past MAX_JSON_DEPTH before parsing: strings and everything but brackets are
    dropped by regular expressions (in C), then only the brackets are walked."""
    brackets = _NOT_A_BRACKET.sub("", _STRING.sub("", text))
    depth = 0
    for char in brackets:
        depth += 1 if char in "[{" else -1
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")


def _lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or object key) holding a lone surrogate, or None."""
    if isinstance(value, str):
        return path if _has_surrogate(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _has_surrogate(key):
                return f"{path}.<key>" if path else "<key>"  # never the key itself: it cannot be printed
            found = _lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _lone_surrogate_at(item, f"{path}.{index}" if path else str(index))
            if found is not None:
                return found
    return None


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


class JsonRequest(Request):
    @overload
    async def get_data(self, cache: bool, as_text: Literal[False], parse_form_data: bool) -> bytes: ...

    @overload
    async def get_data(self, cache: bool, as_text: Literal[True], parse_form_data: bool) -> str: ...

    @overload
    async def get_data(
        self, cache: bool = True, as_text: bool = False, parse_form_data: bool = False
    ) -> str | bytes: ...

    async def get_data(
        self, cache: bool = True, as_text: bool = False, parse_form_data: bool = False
    ) -> str | bytes:
        """Quart's, waiting for the body with asyncio.wait instead of asyncio.wait_for.

        Before Python 3.12, wait_for returns the result when a cancel lands just as what it waits
        for completes. A client that sends its request and closes at once is exactly that: the app
        reads the body and the disconnect together and cancels the handler as the body completes.
        The cancel was lost, and the request ran to its end for nobody. asyncio.wait never drops one."""
        if parse_form_data:  # form parsing is not a gateway route's; Quart's own path
            return await super().get_data(cache, as_text, parse_form_data)
        reading = asyncio.ensure_future(self.body)
        try:
            done, _ = await asyncio.wait({reading}, timeout=self.body_timeout)
        finally:
            if not reading.done():
                reading.cancel()
        if not done:
            raise RequestTimeout()
        raw: bytes = reading.result()
        if not cache:
            self.body.clear()
        return raw.decode() if as_text else raw

    async def get_json(self, force: bool = False, silent: bool = False, cache: bool = True) -> Any:
        if cache and self._cached_json[silent] is not Ellipsis:
            return self._cached_json[silent]
        if not (force or self.is_json):
            return None
        raw = await self.get_data(cache=cache, as_text=False)
        try:
            result = parse_json_body(raw)  # type: ignore[arg-type]
        except InvalidRequest:
            if not silent:
                raise
            result = None
        if cache:
            self._cached_json[silent] = result
        return result
