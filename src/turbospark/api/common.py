"""What every API module shares: the endpoint wrapper, auth, body reading, SSE, disconnects.

`endpoint(render_error)` wraps a handler so that auth is checked, the body is read within its
size bound, and any `ApiError` (or unexpected exception, as a 500) is rendered by that API's own
error renderer: a client always gets its own envelope.

Graceful stop (`Shutdown`): once draining, new requests get a 503; replies still running go on
until the grace period ends, then each event stream read through `until_shutdown` (and each
non-streaming wait in `until_disconnect`) ends with an `ApiError` that the API renders as its
own final error event, between two whole frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse

from turbospark.api import fields as f
from turbospark.api.fields import parse_json_object
from turbospark.errors import ApiError, ErrorKind
from turbospark.registry import ModelNotLoaded, ModelRegistry

log = logging.getLogger("turbospark.api")

T = TypeVar("T")

Handler = Callable[[Request], Awaitable[Response]]
ErrorRenderer = Callable[[ApiError], Response]


class Shutdown:
    """Draining, then (after the grace period) ending what is still running."""

    def __init__(self) -> None:
        self.is_draining = False
        self.is_aborted = False
        self._timeouts: set[asyncio.Timeout] = set()
        self._aborted: asyncio.Event | None = None

    def begin(self, grace_seconds: float) -> None:
        """Stop taking requests; end the running ones after `grace_seconds`. On the event loop."""
        if self.is_draining:
            return
        self.is_draining = True
        asyncio.get_running_loop().call_later(max(0.0, grace_seconds), self.abort)

    def abort(self) -> None:
        """End every reply still running now (each with its API's error event). On the event loop."""
        self.is_aborted = True
        now = asyncio.get_running_loop().time()
        for timeout in list(self._timeouts):
            timeout.reschedule(now)
        self.aborted_event().set()

    def aborted_event(self) -> asyncio.Event:
        if self._aborted is None:
            self._aborted = asyncio.Event()
        return self._aborted

    def error(self) -> ApiError:
        return ApiError(
            ErrorKind.UNAVAILABLE,
            "the server is shutting down: this reply was ended at the end of its grace period",
            retry_after=1.0,
        )


@dataclass
class ServerState:
    registry: ModelRegistry
    api_keys: frozenset[str] = frozenset()
    max_body_bytes: int = 64 * 1024 * 1024
    ping_interval: float = 10.0
    started: float = field(default_factory=time.time)
    shutdown: Shutdown = field(default_factory=Shutdown)


def state_of(request: Request) -> ServerState:
    server: ServerState = request.app.state.server
    return server


def _given_key(request: Request) -> str | None:
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth.lower().startswith("bearer "):
        given = auth[7:].strip()
    return given


def check_auth(request: Request) -> None:
    keys = state_of(request).api_keys
    if not keys:
        return
    given = _given_key(request)
    if given is None:
        raise ApiError(
            ErrorKind.AUTHENTICATION, "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key'"
        )
    if not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys):
        raise ApiError(ErrorKind.AUTHENTICATION, "invalid API key")


def cache_salt(request: Request, body: dict[str, Any]) -> str | None:
    """A request's prefix-cache salt (`GenerationConfig.cache_salt`): the body's `cache_salt` (a
    non-empty string, as vLLM reads it) and, when the server checks API keys, a digest of the
    caller's key, so callers with different keys never share cached blocks (nor time each
    other's prompts through them). None when neither applies: one shared cache."""
    salt = f.string(body, "cache_salt")
    if salt is not None and not salt:
        raise ApiError(
            ErrorKind.INVALID_REQUEST, "'cache_salt' must be a non-empty string", param="cache_salt"
        )
    key = _given_key(request) if state_of(request).api_keys else None
    if key is None:
        return salt
    tenant = "key:" + hashlib.sha256(key.encode()).hexdigest()[:32]
    return tenant if salt is None else f"{tenant}|salt:{salt}"


_BODY_KEY = "turbospark.body"  # the body read once, for a handler run again after a model load


async def read_json(request: Request) -> dict[str, Any]:
    read = request.scope.get(_BODY_KEY)
    if read is not None:
        return parse_json_object(read)
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
    request.scope[_BODY_KEY] = body = b"".join(chunks)
    return parse_json_object(body)


_LOAD_ATTEMPTS = 3


def endpoint(render_error: ErrorRenderer, *, auth: bool = True) -> Callable[[Handler], Handler]:
    def wrap(handler: Handler) -> Handler:
        async def run(request: Request) -> Response:
            try:
                if auth:
                    check_auth(request)
                if state_of(request).shutdown.is_draining:
                    raise ApiError(ErrorKind.UNAVAILABLE, "the server is shutting down", retry_after=1.0)
                for _ in range(_LOAD_ATTEMPTS):
                    try:
                        return await handler(request)
                    except ModelNotLoaded as missing:  # load it (one load per model), then again
                        await missing.registry.ensure_loaded(missing.name)
                raise ApiError(
                    ErrorKind.UNAVAILABLE,
                    "the model was unloaded again before this request could use it; retry",
                    param="model",
                    retry_after=1.0,
                )
            except ApiError as exc:
                return render_error(exc)
            except ClientDisconnect:
                # The client hung up before its body arrived whole: no one is left to answer, and
                # nothing went wrong on this side. 499 is only for the access log and metrics.
                log.debug("client disconnected while sending %s", request.url.path)
                return Response(status_code=499)
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

    shutdown = state_of(request).shutdown
    watcher = asyncio.ensure_future(watch())
    stopper = asyncio.ensure_future(shutdown.aborted_event().wait())
    try:
        await asyncio.wait({task, watcher, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            # Wait for the work to unwind (it gives its slot back only once its worker stopped);
            # a cancelled task has no result to read.
            with contextlib.suppress(BaseException):
                await task
        for helper in (watcher, stopper):
            helper.cancel()
            with contextlib.suppress(BaseException):
                await helper
    if task.cancelled():
        if shutdown.is_aborted:
            raise shutdown.error()
        raise ApiError(ErrorKind.INVALID_REQUEST, "client disconnected", status=499)
    return task.result()


async def until_shutdown(request: Request, events: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """`events`, ended by `Shutdown.error()` (an `ApiError`) once the grace period is over.

    The API's stream body catches that error like any other and writes its error event: the
    cut falls between two events, so no frame is ever torn.
    """
    shutdown = state_of(request).shutdown
    try:
        while True:
            if shutdown.is_aborted:
                raise shutdown.error()
            try:
                async with asyncio.timeout(None) as bound:  # armed by Shutdown.abort()
                    shutdown._timeouts.add(bound)
                    try:
                        item = await anext(events)
                    finally:
                        shutdown._timeouts.discard(bound)
            except StopAsyncIteration:
                return
            except TimeoutError:
                if shutdown.is_aborted:
                    raise shutdown.error() from None
                raise
            yield item
    finally:
        close = getattr(events, "aclose", None)
        if close is not None:
            with contextlib.suppress(BaseException):  # stops the generation behind it
                await close()


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    base = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(body, media_type="text/event-stream", headers={**base, **(headers or {})})


def new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def retry_headers(exc: ApiError) -> dict[str, str]:
    if exc.retry_after is None:
        return {}
    return {"Retry-After": str(max(1, round(exc.retry_after)))}
