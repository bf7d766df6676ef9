"""GET /v1/models and /v1/models/{id}: the model list both the OpenAI and Anthropic SDKs read.

One entry shape carries OpenAI's fields and Anthropic's (type, display_name, created_at), so
either SDK parses it; errors come in Anthropic's envelope to callers that send
`anthropic-version`, in OpenAI's otherwise. Every name a model is served under is listed (its
id and its aliases, Claude Code's included), and every model of the store that is not loaded
yet (it loads on its first request).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbospark.api.common import Handler, endpoint, state_of
from turbospark.api.envelopes import anthropic_error, openai_error
from turbospark.errors import ApiError, ErrorKind
from turbospark.registry import CLAUDE_CODE_ALIAS_PREFIX, model_kinds


def model_entry(model_id: str, created: int, kinds: Sequence[str] = ("completion",)) -> dict[str, Any]:
    """One shape both SDKs parse (see the module docstring), and `capabilities` (["completion"],
    ["embedding"] or both) for clients that pick an embedder."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "turbospark",
        "type": "model",
        "display_name": model_id,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
        "capabilities": list(kinds),
    }


async def list_models(request: Request) -> Response:
    registry = state_of(request).registry
    data = [
        model_entry(name, registry.created, model_kinds(s.backend))
        for s in registry.served()
        for name in s.names()
    ]
    ids = [entry["id"] for entry in data]
    # the store's models that are not loaded: they load on their first request
    for entry in registry.store.entries() if registry.store is not None else []:
        names = [entry.name]
        if "completion" in entry.kinds:
            names.append(CLAUDE_CODE_ALIAS_PREFIX + entry.name)
        for name in names:
            if registry.lookup(name) is None and name not in ids:
                ids.append(name)
                data.append(model_entry(name, int(entry.modified) or registry.created, entry.kinds))
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "has_more": False,
            "first_id": ids[0] if ids else None,
            "last_id": ids[-1] if ids else None,
        }
    )


async def get_model(request: Request) -> Response:
    registry = state_of(request).registry
    name = request.path_params["model_id"]
    served = registry.lookup(name)
    if served is not None:
        return JSONResponse(model_entry(name, registry.created, model_kinds(served.backend)))
    entry = registry.store_entry(name)
    if entry is None:
        raise ApiError(ErrorKind.NOT_FOUND, f"model {name!r} not found", param="model")
    return JSONResponse(model_entry(name, int(entry.modified) or registry.created, entry.kinds))


def by_caller(handler: Handler) -> Handler:
    """`handler` with errors in the envelope of the API the caller speaks."""
    as_anthropic = endpoint(anthropic_error)(handler)
    as_openai = endpoint(openai_error)(handler)

    async def run(request: Request) -> Response:
        if "anthropic-version" in request.headers:
            return await as_anthropic(request)
        return await as_openai(request)

    run.__name__ = handler.__name__
    return run


def routes() -> list[Route]:
    return [
        Route("/v1/models", by_caller(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", by_caller(get_model), methods=["GET"]),
    ]
