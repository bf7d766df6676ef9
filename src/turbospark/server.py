"""The ASGI app: every API's routes over one registry, plus health, and the uvicorn server.

Each API module contributes `routes()`; the app holds the `ServerState` (registry, API keys,
limits, shutdown) that handlers read through `turbospark.api.common.state_of`. A path or method
no route answers gets a JSON 404 / 405 in the envelope of the API the path belongs to. CORS is
off unless origins are allowed. `GracefulServer` turns SIGTERM / SIGINT into a graceful stop
(drain, grace period, final error events) that exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Generator, Sequence
from types import FrameType

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from turbospark import __version__, metrics, webui
from turbospark.api import anthropic, embeddings, models, ollama, openai, openapi, operations, responses
from turbospark.api.common import ServerState, Shutdown, state_of
from turbospark.api.envelopes import anthropic_error, ollama_error, openai_error_body
from turbospark.errors import ApiError, ErrorKind


async def health(request: Request) -> Response:
    server = state_of(request)
    loading = server.registry.num_loading
    models = [b.model_id for b in server.registry.backends()]
    if server.shutdown.is_draining:
        return JSONResponse({"status": "shutting_down", "models": models}, status_code=503)
    if loading:
        return JSONResponse({"status": "loading", "models": models, "loading": loading}, status_code=503)
    return JSONResponse({"status": "ok", "models": models, "version": __version__})


def render_unrouted(request: Request, exc: ApiError) -> Response:
    """An error for a request no route took, in the envelope its path (or headers) suggest."""
    path = request.url.path
    if path.startswith("/api/"):
        return ollama_error(exc)
    if path.startswith("/v1/messages") or "anthropic-version" in request.headers:
        return anthropic_error(exc)
    body = openai_error_body(exc)
    body["error"]["code"] = None  # not "model_not_found": no route, whatever the model
    return JSONResponse(body, status_code=exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        allowed = exc.headers.get("Allow", "") if exc.headers else ""
        error = ApiError(
            ErrorKind.INVALID_REQUEST,
            f"method {request.method} is not allowed on {request.url.path}; allowed: {allowed}",
            status=405,
        )
        reply = render_unrouted(request, error)
        if allowed:
            reply.headers["Allow"] = allowed
        return reply
    if exc.status_code == 404:
        error = ApiError(ErrorKind.NOT_FOUND, f"no route for {request.method} {request.url.path}", status=404)
    else:
        error = ApiError(ErrorKind.INVALID_REQUEST, str(exc.detail), status=exc.status_code)
    return render_unrouted(request, error)


def create_app(state: ServerState, *, cors_origins: Sequence[str] = (), web_ui: bool = True) -> Starlette:
    routes: list[BaseRoute] = [Route("/health", health, methods=["GET"])]
    # Each API module contributes routes(); no two share a path.
    routes += operations.routes()
    routes += models.routes()  # /v1/models, in the envelope of the caller's API
    routes += anthropic.routes()
    routes += openai.routes()
    routes += responses.routes()
    routes += ollama.routes()
    routes += embeddings.routes()
    routes += metrics.routes()
    routes += openapi.routes()
    middleware = [Middleware(metrics.RequestMetrics)]
    if web_ui:  # the chat page at /chat, and at / for browsers (others still get Ollama's answer)
        routes += webui.routes()
        middleware.append(Middleware(webui.BrowserHome))
    if cors_origins:
        # Browsers on these origins may call every route; keys travel in headers, not cookies.
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(cors_origins),
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=["Retry-After"],
                max_age=600,
            )
        )
    app = Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: _http_error})
    app.state.server = state
    return app


class GracefulServer(uvicorn.Server):
    """uvicorn with a graceful stop on SIGTERM / SIGINT that exits 0.

    The first signal stops accepting connections and answers new requests 503; replies still
    running get `grace_seconds` to finish, then end with their API's error event. A second
    signal ends them at once. uvicorn's own task cancel stays as a backstop a few seconds later.
    """

    def __init__(self, config: uvicorn.Config, shutdown: Shutdown, grace_seconds: float) -> None:
        config.timeout_graceful_shutdown = int(grace_seconds) + 5
        super().__init__(config)
        self.drain = shutdown
        self.grace_seconds = grace_seconds
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # Unlike uvicorn's, the signal is not raised again afterwards: a graceful stop exits 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if self.should_exit:  # a second signal: end everything now
            self.force_exit = True
            if loop is not None:
                loop.call_soon_threadsafe(self.drain.abort)
            return
        self.should_exit = True
        if loop is not None:
            loop.call_soon_threadsafe(self.drain.begin, self.grace_seconds)
