"""The ASGI app: every API's routes over one registry, plus health.

Each API module contributes `routes()`; the app holds the `ServerState` (registry, API keys,
limits) that handlers read through `turbospark.api.common.state_of`.
"""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from turbospark import __version__, metrics
from turbospark.api import anthropic, models, ollama, openai, operations, responses
from turbospark.api.common import ServerState, state_of


async def health(request: Request) -> Response:
    server = state_of(request)
    loading = server.registry.num_loading
    models = [b.model_id for b in server.registry.backends()]
    if loading:
        return JSONResponse({"status": "loading", "models": models, "loading": loading}, status_code=503)
    return JSONResponse({"status": "ok", "models": models, "version": __version__})


def create_app(state: ServerState) -> Starlette:
    routes: list[BaseRoute] = [Route("/health", health, methods=["GET"])]
    # Each API module contributes routes(); no two share a path.
    routes += operations.routes()
    routes += models.routes()  # /v1/models, in the envelope of the caller's API
    routes += anthropic.routes()
    routes += openai.routes()
    routes += responses.routes()
    routes += ollama.routes()
    routes += metrics.routes()
    app = Starlette(routes=routes)
    app.state.server = state
    return app
