"""What every API module shares: the endpoint wrapper, auth, body reading, SSE, disconnects.

`endpoint(render_error)` wraps a handler so that auth is checked, the body is read within its
size bound, and any `ApiError` (or unexpected exception, as a 500) is rendered by that API's own
error renderer: a client always gets its own envelope.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from turbospark.api.fields import parse_json_object
from turbospark.errors import ApiError, ErrorKind
from turbospark.registry import ModelRegistry

log = logging.getLogger("turbospark.api")

T = TypeVar("T")

Handler = Callable[[Request], Awaitable[Response]]
ErrorRenderer = Callable[[ApiError], Response]


@dataclass
class ServerState:
    registry: ModelRegistry
    api_keys: frozenset[str] = frozenset()
    max_body_bytes: int = 64 * 1024 * 1024
    ping_interval: float = 10.0
    started: float = field(default_factory=time.time)


def state_of(request: Request) -> ServerState:
    server: ServerState = request.app.state.server
    return server


def check_auth(request: Request) -> None:
    keys = state_of(request).api_keys
    if not keys:
        return
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    if given is None:
        raise ApiError(
            ErrorKind.AUTHENTICATION, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key'"
        )
    if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
        raise ApiError(ErrorKind.AUTHENTICATION, "invalid API key")


async def read_json(request: Request) -> dict[str, Any]:
    limit = state_of(request).max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(ErrorKind.TOO_LARGE, f"request body is {declared} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(ErrorKind.TOO_LARGE, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return parse_json_object(b"".join(chunks))


def endpoint(render_error: ErrorRenderer, *, auth: bool = True) -> Callable[[Handler], Handler]:
    def wrap(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            try:
                if auth:
                    check_auth(request)
                return await handler(request)
            except ApiError as exc:
                return render_error(exc)
            except Exception as exc:
                log.exception("unhandled error in %s", request.url.path)
                return render_error(
                    ApiError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
                )

        run.__name__ = handler.__name__
        return run

    return wrap


async def until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Runs `work`, cancelling it if the client goes away first (non-streaming replies)."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watcher.cancel()
        with contextlib.suppress(BaseException):
            await watcher
    if task.cancelled():
        with contextlib.suppress(BaseException):
            await task
        raise ApiError(ErrorKind.INVALID_REQUEST, "client disconnected", status=499)
    return task.result()


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body, media_type="text/event-stream", headers={**base, **(headers or {})})


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def retry_headers(exc: ApiError) -> dict[str, str]:
    if exc.retry_after is None:
        return {}
    return {"Retry-After": str(max(1, round(exc.retry_after)))}
