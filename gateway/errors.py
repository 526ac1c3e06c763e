"""The gateway's error hierarchy and its one renderer, in OpenAI's error shape.

Runs in the gateway process. Every HTTP error leaves through `error_body`, as
`{"error": {"message", "type", "param", "code"}}`; nothing here ever includes a traceback.
"""

from __future__ import annotations

import asyncio
from typing import Any


class APIError(Exception):
    status = 500
    type = "server_error"
    code: str | None = "internal_error"
    # False for errors that the same request meets again (bad parameters, a prompt too long, a
    # deadline): they carry `x-should-retry: false`, which the OpenAI SDKs obey instead of retrying.
    retryable = True

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}
        if not self.retryable:
            self.headers.setdefault("x-should-retry", "false")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"
    retryable = False


class AuthenticationFailed(APIError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PermissionDenied(APIError):
    status = 403
    type = "permission_error"
    code = "permission_denied"


class UnsupportedMediaType(APIError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class ModelNotFound(APIError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model '{model}' does not exist", param="model")


class NotFound(APIError):
    """A stored object (a response) that does not exist, or that this API key may not see."""

    status = 404
    type = "invalid_request_error"
    code = "not_found"
    retryable = False


class Conflict(APIError):
    """The action conflicts with one already under way (a second reload while one applies)."""

    status = 409
    type = "invalid_request_error"
    code = "conflict"


class RequestTimeout(APIError):
    """The request's own deadline passed; the same request would time out again."""

    status = 408
    type = "timeout_error"
    code = "request_timeout"
    retryable = False


class QueueFull(APIError):
    status = 429
    type = "rate_limit_error"
    code = "queue_full"


class ServiceUnavailable(APIError):
    status = 503
    type = "service_unavailable_error"
    code = "service_unavailable"


class WorkerFailed(ServiceUnavailable):
    """The worker serving the request died or was lost; the request cannot continue."""

    code = "worker_failed"


class ClientClosed(APIError):
    """The client went away before the response was complete (nginx's 499); never sent to anyone."""

    status = 499
    type = "client_closed"
    code = "client_closed"

    def __init__(self, message: str = "the client closed the connection") -> None:
        super().__init__(message)


def as_api_error(exc: BaseException) -> APIError:
    """The APIError a request ends with when `exc` ends it."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return ClientClosed()
    return APIError("internal server error")


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
