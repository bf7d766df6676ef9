"""Each API's error envelope, in one place: an `ApiError` as OpenAI, Anthropic or Ollama JSON.

An API module renders its errors with its own envelope here; routes that several APIs share
(`/v1/models`, `/tokenize`) pick one per caller. The in-stream forms (an SSE `data:` or `event:
error` frame, an NDJSON line) are built by each API from the same bodies.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.responses import JSONResponse, Response

from turbospark.api.common import retry_headers
from turbospark.errors import ApiError, ErrorKind

_OPENAI_TYPES = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.PERMISSION: "permission_error",
    ErrorKind.NOT_FOUND: "invalid_request_error",
    ErrorKind.TOO_LARGE: "invalid_request_error",
    ErrorKind.OVERLOADED: "rate_limit_error",
    ErrorKind.UNAVAILABLE: "server_error",
    ErrorKind.INTERNAL: "server_error",
}
_OPENAI_CODES = {ErrorKind.NOT_FOUND: "model_not_found", ErrorKind.AUTHENTICATION: "invalid_api_key"}


def openai_error_body(exc: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": exc.message,
            "type": _OPENAI_TYPES[exc.kind],
            "param": exc.param,
            "code": exc.code or _OPENAI_CODES.get(exc.kind),
        }
    }


def openai_error(exc: ApiError) -> Response:
    return JSONResponse(openai_error_body(exc), status_code=exc.status, headers=retry_headers(exc))


_ANTHROPIC_TYPES = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.PERMISSION: "permission_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.TOO_LARGE: "request_too_large",
    ErrorKind.OVERLOADED: "overloaded_error",
    ErrorKind.UNAVAILABLE: "api_error",
    ErrorKind.INTERNAL: "api_error",
}
ANTHROPIC_OVERLOADED_STATUS = 529  # Anthropic's status for a full admission queue


def anthropic_error_body(exc: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES[exc.kind], "message": exc.message}}


def anthropic_error(exc: ApiError) -> Response:
    status = ANTHROPIC_OVERLOADED_STATUS if exc.kind is ErrorKind.OVERLOADED else exc.status
    return Response(
        orjson.dumps(anthropic_error_body(exc)),
        status_code=status,
        media_type="application/json",
        headers=retry_headers(exc),
    )


OLLAMA_OVERLOADED_STATUS = 503  # Ollama's own "server busy" status for a full line


def ollama_error_body(exc: ApiError) -> dict[str, Any]:
    return {"error": exc.message}


def ollama_error(exc: ApiError) -> Response:
    status = OLLAMA_OVERLOADED_STATUS if exc.kind is ErrorKind.OVERLOADED else exc.status
    return JSONResponse(ollama_error_body(exc), status_code=status, headers=retry_headers(exc))
