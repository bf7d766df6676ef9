"""Errors every API renders into its own envelope.

Code past the wire edge raises `ApiError` with a kind; the API module that received the request
turns it into OpenAI's, Anthropic's or Ollama's error body and status. The message always says
what was wrong (and `param` names the field, where one was).
"""

from __future__ import annotations

from enum import StrEnum


class ErrorKind(StrEnum):
    INVALID_REQUEST = "invalid_request"  # 400
    AUTHENTICATION = "authentication"  # 401
    PERMISSION = "permission"  # 403
    NOT_FOUND = "not_found"  # 404
    TOO_LARGE = "too_large"  # 413
    OVERLOADED = "overloaded"  # 429 / 529 / 503, with Retry-After
    UNAVAILABLE = "unavailable"  # 503 (still loading)
    INTERNAL = "internal"  # 500: a bug, never a bad request


DEFAULT_STATUS = {
    ErrorKind.INVALID_REQUEST: 400,
    ErrorKind.AUTHENTICATION: 401,
    ErrorKind.PERMISSION: 403,
    ErrorKind.NOT_FOUND: 404,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.OVERLOADED: 429,
    ErrorKind.UNAVAILABLE: 503,
    ErrorKind.INTERNAL: 500,
}


class ApiError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        *,
        param: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.param = param
        self.status = status if status is not None else DEFAULT_STATUS[kind]
        self.retry_after = retry_after
        self.code = code  # a machine-readable cause where APIs name one (context_length_exceeded)


def invalid(message: str, param: str | None = None, *, code: str | None = None) -> ApiError:
    return ApiError(ErrorKind.INVALID_REQUEST, message, param=param, code=code)
