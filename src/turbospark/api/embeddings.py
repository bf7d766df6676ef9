"""Embeddings in two wire formats: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and the
older POST /api/embeddings.

Each route validates its body once, finds the model (a model that cannot embed is a 400 naming
it and the models that can), hands the inputs to the backend's batching queue and renders the
vectors in its own envelope; errors leave in the caller's error envelope.

- OpenAI: `input` is a string, an array of strings, an array of token ids or an array of token
  id arrays (ids are the model's own, special tokens included, as given); `encoding_format`
  "float" or "base64" (little-endian float32 bytes, what the openai SDK asks for by default);
  `dimensions` only where the model was trained for shorter vectors (none served today: any
  other value than the model's own size is a 400, never a silent cut); `usage` counts every
  token run, special tokens included.
- Ollama /api/embed: `input` a string or an array of strings, `truncate` (default true, as in
  Ollama: an over-long input is cut to the model's limit; false makes it a 400),
  `dimensions` as above, `keep_alive` and `options` accepted (models stay loaded). A body
  without `input` is Ollama's "load the model" request: an empty list of embeddings.
- Ollama /api/embeddings: `prompt` -> `{"embedding": [...]}`; no truncation (an over-long prompt
  is a 400); a body without `prompt` answers an empty embedding, as Ollama does.

An empty input (an empty string, array or token array) is a 400 everywhere.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any, Protocol, runtime_checkable

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbospark.api import fields as f
from turbospark.api.common import endpoint, read_json, state_of, until_disconnect
from turbospark.api.envelopes import ollama_error, openai_error
from turbospark.backend import Backend, BackendError, Embedder
from turbospark.errors import ApiError, ErrorKind, invalid

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request

EmbedInput = str | Sequence[int]


@runtime_checkable
class BatchEmbedder(Protocol):
    """What a backend offers beyond `Embedder.encode` (see `turbospark.engine.embedder`)."""

    dimensions: int

    def submit(
        self, inputs: Sequence[EmbedInput], *, truncate: bool = False, hint: str = ""
    ) -> Future[Any]: ...


# ---------------------------------------------------------------- shared


def embedding_backend(request: Request, name: str) -> Embedder:
    registry = state_of(request).registry
    backend = registry.resolve(name).backend
    if not isinstance(backend, Embedder):
        able = sorted(b.model_id for b in registry.backends() if isinstance(b, Embedder))
        served = f"; this server embeds with: {', '.join(able)}" if able else "; no model served here embeds"
        raise invalid(
            f"model {backend.model_id!r} is a chat model and cannot create embeddings{served}", "model"
        )
    return backend


def check_dimensions(backend: Backend, requested: int | None) -> None:
    size = int(getattr(backend, "dimensions", 0) or 0)
    if requested is None or requested == size:
        return
    raise invalid(
        f"model {backend.model_id!r} makes {size}-dimensional vectors and was not trained for shorter ones "
        f"(Matryoshka), so it cannot cut them to {requested}; leave 'dimensions' out or set it to {size}",
        "dimensions",
    )


def _as_api_error(exc: BackendError, param: str) -> ApiError:
    if exc.status == 429:
        return ApiError(ErrorKind.OVERLOADED, str(exc), retry_after=1.0)
    if exc.status < 500:
        return ApiError(ErrorKind.INVALID_REQUEST, str(exc), param=param, status=exc.status)
    return ApiError(ErrorKind.INTERNAL, str(exc))


async def embed(
    request: Request, backend: Embedder, inputs: list[EmbedInput], *, truncate: bool, hint: str, param: str
) -> tuple[np.ndarray, int]:
    """(vectors (n, dim) float32, tokens run) for a request's inputs; bad input is a 400."""
    try:
        if isinstance(backend, BatchEmbedder):
            future = backend.submit(inputs, truncate=truncate, hint=hint)

            async def wait() -> Any:
                return await asyncio.wrap_future(future)

            result = await until_disconnect(request, wait())
            return result.vectors, int(result.num_tokens)
        # a backend with only the protocol's encode(texts)
        if not all(isinstance(x, str) for x in inputs):
            raise invalid(f"model {backend.model_id!r} embeds text only, not token ids", param)
        texts = [x for x in inputs if isinstance(x, str)]
        vectors = await asyncio.get_running_loop().run_in_executor(None, backend.encode, texts)
        tokens = sum(len(backend.tokenizer.encode(t, add_special_tokens=True)) for t in texts)
        return np.asarray(vectors, dtype=np.float32), tokens
    except BackendError as exc:
        raise _as_api_error(exc, param) from exc


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _nonempty(items: list[EmbedInput], param: str) -> list[EmbedInput]:
    if not items:
        raise invalid(f"'{param}' is empty: there is nothing to embed", param)
    if len(items) > MAX_INPUTS:
        raise invalid(f"'{param}' has {len(items)} inputs; at most {MAX_INPUTS} per request", param)
    for i, item in enumerate(items):
        if len(item) == 0:
            where = param if len(items) == 1 else f"{param}[{i}]"
            raise invalid(f"'{where}' is empty: there is nothing to embed", where)
    return items


# ---------------------------------------------------------------- OpenAI


def parse_openai_input(raw: Any) -> list[EmbedInput]:
    shapes = "a string, an array of strings, an array of token ids or an array of token id arrays"
    if raw is None:
        raise invalid("'input' is required", "input")
    if isinstance(raw, str):
        return _nonempty([raw], "input")
    if not isinstance(raw, list):
        raise invalid(f"'input' must be {shapes}", "input")
    if not raw or all(isinstance(x, str) for x in raw):
        return _nonempty(list(raw), "input")
    if all(_is_token_id(x) for x in raw):
        return _nonempty([raw], "input")
    if all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in raw):
        return _nonempty(list(raw), "input")
    raise invalid(f"'input' must be {shapes}", "input")


async def openai_embeddings(request: Request) -> Response:
    body = await read_json(request)
    model = f.string(body, "model", required=True) or ""
    inputs = parse_openai_input(body.get("input"))
    encoding = f.string(body, "encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid(f"'encoding_format' must be 'float' or 'base64', not {encoding!r}", "encoding_format")
    dimensions = f.integer(body, "dimensions", minimum=1)
    f.string(body, "user")  # accepted, unused
    backend = embedding_backend(request, model)
    check_dimensions(backend, dimensions)
    vectors, tokens = await embed(request, backend, inputs, truncate=False, hint="", param="input")
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": base64.b64encode(vec.astype("<f4").tobytes()).decode()
            if encoding == "base64"
            else vec,
        }
        for i, vec in enumerate(vectors)
    ]
    reply = {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    return Response(orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


# ---------------------------------------------------------------- Ollama


def _ollama_common(body: dict[str, Any]) -> tuple[str, int | None]:
    model = f.string(body, "model", required=True) or ""
    if not model:
        raise invalid("'model' is required", "model")
    keep_alive = body.get("keep_alive")
    if keep_alive is not None and (
        isinstance(keep_alive, bool) or not isinstance(keep_alive, str | int | float)
    ):
        raise invalid("'keep_alive' must be a number of seconds or a duration like \"5m\"", "keep_alive")
    f.obj(body, "options")  # accepted: sampling options mean nothing to an encoder
    return model, f.integer(body, "dimensions", minimum=1)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


async def ollama_embed(request: Request) -> Response:
    started = time.monotonic()
    body = await read_json(request)
    model, dimensions = _ollama_common(body)
    raw = body.get("input")
    truncate = f.boolean(body, "truncate", True)
    backend = embedding_backend(request, model)
    check_dimensions(backend, dimensions)
    if raw is None:  # Ollama's "load the model" request
        return JSONResponse({"model": model, "embeddings": []})
    if isinstance(raw, str):
        inputs = _nonempty([raw], "input")
    elif isinstance(raw, list) and all(isinstance(x, str) for x in raw):
        inputs = _nonempty(list(raw), "input")
    else:
        raise invalid("'input' must be a string or an array of strings", "input")
    hint = " or leave 'truncate' at true to cut it to fit"
    vectors, tokens = await embed(request, backend, inputs, truncate=truncate, hint=hint, param="input")
    reply = {
        "model": model,
        "embeddings": vectors,
        "total_duration": _ns(time.monotonic() - started),
        "load_duration": 0,  # models stay loaded for the server's life
        "prompt_eval_count": tokens,
    }
    return Response(orjson.dumps(reply, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json")


async def ollama_embeddings(request: Request) -> Response:
    body = await read_json(request)
    model, _ = _ollama_common(body)
    prompt = f.string(body, "prompt")
    backend = embedding_backend(request, model)
    if prompt is None:  # Ollama answers an empty embedding to a body without a prompt
        return JSONResponse({"embedding": []})
    inputs = _nonempty([prompt], "prompt")
    hint = " (/api/embed cuts over-long inputs to fit)"
    vectors, _ = await embed(request, backend, inputs, truncate=False, hint=hint, param="prompt")
    return Response(
        orjson.dumps({"embedding": vectors[0]}, option=orjson.OPT_SERIALIZE_NUMPY),
        media_type="application/json",
    )


def routes() -> list[Route]:
    openai_route = endpoint(openai_error)
    ollama_route = endpoint(ollama_error)
    return [
        Route("/v1/embeddings", openai_route(openai_embeddings), methods=["POST"]),
        Route("/api/embed", ollama_route(ollama_embed), methods=["POST"]),
        Route("/api/embeddings", ollama_route(ollama_embeddings), methods=["POST"]),
    ]
