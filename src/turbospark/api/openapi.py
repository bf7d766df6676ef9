"""`GET /openapi.json`: an OpenAPI 3.1 description of every route, built from the live registry.

It describes what the parsers accept (so a fuzzer's schema-valid requests are valid and its
invalid ones are refused with a 4xx): `model` is the served ids and aliases (any string when a
fallback model is set), unknown extra fields are allowed (real clients send many), and each
route's errors use its API's envelope. Written by hand, not generated from the handlers: the
handlers validate with `api/fields.py`, not with schema classes a generator could read.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbospark import __version__
from turbospark.api.common import endpoint, state_of
from turbospark.api.envelopes import openai_error
from turbospark.registry import ModelRegistry

Schema = dict[str, Any]

STR: Schema = {"type": "string"}
BOOL: Schema = {"type": "boolean"}
OBJ: Schema = {"type": "object"}
NULLABLE_STR: Schema = {"type": ["string", "null"]}


def _int(minimum: int | None = None, maximum: int | None = None) -> Schema:
    out: Schema = {"type": "integer"}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _num(minimum: float, maximum: float | None = None) -> Schema:
    out: Schema = {"type": "number", "minimum": minimum}
    if maximum is not None:
        out["maximum"] = maximum
    return out


def _obj(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    """An object; an optional field may also be null (the parsers read null as absent)."""
    optional = {
        k: {"anyOf": [v, {"type": "null"}]} for k, v in properties.items() if k not in (required or [])
    }
    out: Schema = {"type": "object", "properties": {**properties, **optional}}
    if required:
        out["required"] = required
    return out


def _arr(items: Schema, min_items: int = 0) -> Schema:
    out: Schema = {"type": "array", "items": items}
    if min_items:
        out["minItems"] = min_items
    return out


def _one_of(*options: Schema) -> Schema:
    return {"anyOf": list(options)}


STOP: Schema = _one_of(STR, _arr(STR))

# ---------------------------------------------------------------- error envelopes

OPENAI_ERROR = _obj(
    {
        "error": _obj(
            {"message": STR, "type": STR, "param": NULLABLE_STR, "code": NULLABLE_STR},
            ["message", "type"],
        )
    },
    ["error"],
)
ANTHROPIC_ERROR = _obj(
    {"type": {"const": "error"}, "error": _obj({"type": STR, "message": STR}, ["type", "message"])},
    ["type", "error"],
)
OLLAMA_ERROR = _obj({"error": STR}, ["error"])
ERRORS = {"openai": OPENAI_ERROR, "anthropic": ANTHROPIC_ERROR, "ollama": OLLAMA_ERROR}


# What one reply (or, for streams, one SSE event / NDJSON line) looks like.
_MEDIA_SCHEMAS: dict[str, Schema] = {
    "application/json": OBJ,
    "application/x-ndjson": OBJ,
    "text/event-stream": _obj({"event": STR, "data": STR, "id": STR}, ["data"]),
    "text/plain": STR,
}


def _responses(api: str, *media: str) -> Schema:
    error = {"content": {"application/json": {"schema": ERRORS[api]}}}
    ok = {
        "description": "success",
        "content": {m: {"schema": _MEDIA_SCHEMAS[m]} for m in media},
    }
    out: Schema = {"200": ok}
    for status in ("400", "401", "404", "405", "413", "429", "499", "503"):
        out[status] = {"description": "an error in the API's envelope", **error}
    if api == "anthropic":
        out["529"] = {"description": "overloaded", **error}
    return out


# ---------------------------------------------------------------- request bodies


def _openai_chat(model: Schema) -> Schema:
    part = _obj({"type": STR, "text": STR, "image_url": _one_of(STR, _obj({"url": STR}))}, ["type"])
    content = _one_of(STR, _arr(part), {"type": "null"})
    call = _obj(
        {"id": STR, "type": STR, "function": _obj({"name": STR, "arguments": STR}, ["name"])}, ["function"]
    )
    message = _obj(
        {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
            "content": content,
            "name": STR,
            "tool_calls": _arr(call),
            "tool_call_id": STR,
        },
        ["role"],
    )
    tool = _obj(
        {
            "type": {"const": "function"},
            "function": _obj({"name": STR, "description": STR, "parameters": OBJ, "strict": BOOL}, ["name"]),
        },
        ["function"],
    )
    return _obj(
        {
            "model": model,
            "messages": _arr(message, 1),
            "stream": BOOL,
            "stream_options": _obj({"include_usage": BOOL}),
            "max_tokens": _int(1),
            "max_completion_tokens": _int(1),
            "n": _int(1, 16),
            "temperature": _num(0, 2),
            "top_p": _num(0, 1),
            "top_k": _int(-1),
            "min_p": _num(0, 1),
            "presence_penalty": _num(-2, 2),
            "frequency_penalty": _num(-2, 2),
            "repetition_penalty": _num(0.01, 10),
            "seed": _int(),
            "stop": STOP,
            "logprobs": BOOL,
            "top_logprobs": _int(0, 20),
            "logit_bias": {"type": "object", "additionalProperties": _num(-100, 100)},
            "tools": _arr(tool),
            "tool_choice": _one_of({"enum": ["auto", "none", "required"]}, OBJ),
            "parallel_tool_calls": BOOL,
            "response_format": _obj({"type": {"enum": ["text", "json_object", "json_schema"]}}, ["type"]),
            "reasoning_effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]},
        },
        ["model", "messages"],
    )


def _openai_completion(model: Schema) -> Schema:
    return _obj(
        {
            "model": model,
            "prompt": _one_of(STR, _arr(STR)),
            "stream": BOOL,
            "max_tokens": _int(1),
            "n": _int(1, 16),
            "temperature": _num(0, 2),
            "top_p": _num(0, 1),
            "seed": _int(),
            "stop": STOP,
            "logprobs": _int(0, 5),
            "echo": BOOL,
        },
        ["model", "prompt"],
    )


def _anthropic_messages(model: Schema, count_only: bool) -> Schema:
    block = _obj({"type": STR, "text": STR}, ["type"])
    content = _one_of(STR, _arr(block))
    message = _obj(
        {"role": {"enum": ["user", "assistant", "system"]}, "content": content}, ["role", "content"]
    )
    tool = _obj({"name": STR, "description": STR, "input_schema": OBJ}, ["name", "input_schema"])
    props: dict[str, Schema] = {
        "model": model,
        "messages": _arr(message, 1),
        "system": _one_of(STR, _arr(block)),
        "tools": _arr(tool),
        "tool_choice": _obj({"type": {"enum": ["auto", "any", "tool", "none"]}, "name": STR}, ["type"]),
        "thinking": _obj({"type": {"enum": ["enabled", "disabled", "adaptive"]}, "budget_tokens": _int(1)}),
        "metadata": OBJ,
        "temperature": _num(0, 1),
        "top_p": _num(0, 1),
        "top_k": _int(0),
    }
    required = ["model", "messages"]
    if not count_only:
        props |= {
            "max_tokens": _int(1),
            "stream": BOOL,
            "stop_sequences": _arr({"type": "string", "minLength": 1}),
        }
        required.append("max_tokens")
    return _obj(props, required)


def _responses_create(model: Schema) -> Schema:
    item = _obj({"type": STR, "role": STR, "content": _one_of(STR, _arr(OBJ))})
    tool = _obj(
        {"type": {"const": "function"}, "name": STR, "description": STR, "parameters": OBJ}, ["type", "name"]
    )
    return _obj(
        {
            "model": model,
            "input": _one_of(STR, _arr(item, 1)),
            "instructions": STR,
            "stream": BOOL,
            "store": BOOL,
            "max_output_tokens": _int(1),
            "temperature": _num(0, 2),
            "top_p": _num(0, 1),
            "top_logprobs": _int(0, 20),
            "tools": _arr(tool),
            "tool_choice": _one_of({"enum": ["auto", "none", "required"]}, OBJ),
            "parallel_tool_calls": BOOL,
            "reasoning": _obj({"effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]}}),
            "text": _obj(
                {"format": _obj({"type": {"enum": ["text", "json_object", "json_schema"]}}, ["type"])}
            ),
        },
        ["model", "input"],
    )


def _ollama_options() -> Schema:
    return _obj(
        {
            "temperature": _num(0),
            "top_p": _num(0, 1),
            "top_k": _int(-1),
            "min_p": _num(0, 1),
            "seed": _int(),
            "num_predict": _int(-2),
            "num_ctx": _int(1),
            "repeat_penalty": _num(0, 10),
            "stop": STOP,
        }
    )


def _ollama_chat(model: Schema) -> Schema:
    message = _obj(
        {
            "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
            "content": STR,
            "images": _arr(STR),
        },
        ["role"],
    )
    return _obj(
        {
            "model": model,
            "messages": _arr(message),
            "stream": BOOL,
            "format": _one_of({"const": "json"}, OBJ),
            "think": _one_of(BOOL, {"enum": ["low", "medium", "high"]}),
            "options": _ollama_options(),
            "keep_alive": _one_of(STR, {"type": "number"}),
        },
        ["model"],
    )


def _ollama_generate(model: Schema) -> Schema:
    return _obj(
        {
            "model": model,
            "prompt": STR,
            "system": STR,
            "raw": BOOL,
            "stream": BOOL,
            "format": _one_of({"const": "json"}, OBJ),
            "think": _one_of(BOOL, {"enum": ["low", "medium", "high"]}),
            "options": _ollama_options(),
            "keep_alive": _one_of(STR, {"type": "number"}),
        },
        ["model"],
    )


# ---------------------------------------------------------------- the document


def _model_schema(registry: ModelRegistry) -> Schema:
    if registry.fallback:
        return STR  # any id is served by the fallback model
    names = sorted({n for served in registry.served() for n in served.names()})
    return {"type": "string", "enum": names} if names else STR


def _post(api: str, summary: str, body: Schema, *media: str) -> Schema:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": _responses(api, *(media or ("application/json",))),
        }
    }


def _get(
    api: str, summary: str, media: str = "application/json", params: list[Schema] | None = None
) -> Schema:
    op: Schema = {"summary": summary, "responses": _responses(api, media)}
    if params:
        op["parameters"] = params
    return {"get": op}


def _path_param(name: str) -> Schema:
    return {"name": name, "in": "path", "required": True, "schema": STR}


def openapi_document(registry: ModelRegistry, *, requires_key: bool = False) -> dict[str, Any]:
    model = _model_schema(registry)
    sse = "text/event-stream"
    ndjson = "application/x-ndjson"
    json = "application/json"
    # `name` is the older field: read only when `model` is absent, so it is any string beside it
    show = {"anyOf": [_obj({"model": model, "name": STR}, ["model"]), _obj({"name": model}, ["name"])]}
    paths: dict[str, Schema] = {
        "/health": _get("openai", "liveness and readiness (503 while loading or shutting down)"),
        "/v1/chat/completions": _post("openai", "OpenAI chat completion", _openai_chat(model), json, sse),
        "/v1/completions": _post("openai", "OpenAI text completion", _openai_completion(model), json, sse),
        "/v1/models": _get("openai", "served models (Anthropic's shape with an anthropic-version header)"),
        "/v1/models/{model_id}": _get("openai", "one served model", params=[_path_param("model_id")]),
        "/v1/responses": _post("openai", "OpenAI Responses (stateless)", _responses_create(model), json, sse),
        "/v1/responses/{response_id}": {
            **_get("openai", "always 404: nothing is stored", params=[_path_param("response_id")]),
            "delete": _get("openai", "always 404: nothing is stored", params=[_path_param("response_id")])[
                "get"
            ],
        },
        "/v1/messages": _post(
            "anthropic", "Anthropic messages", _anthropic_messages(model, False), json, sse
        ),
        "/v1/messages/count_tokens": _post(
            "anthropic", "Anthropic token count", _anthropic_messages(model, True)
        ),
        "/api/chat": _post("ollama", "Ollama chat", _ollama_chat(model), json, ndjson),
        "/api/generate": _post("ollama", "Ollama generate", _ollama_generate(model), json, ndjson),
        "/api/tags": _get("ollama", "Ollama model list"),
        "/api/show": _post("ollama", "Ollama model details", show),
        "/api/ps": _get("ollama", "Ollama loaded models"),
        "/api/version": _get("ollama", "Ollama API version"),
        "/": _get("ollama", "Ollama liveness probe", "text/plain"),
        "/tokenize": _post(
            "openai",
            "tokenize a prompt, or the rendered chat of messages",
            _obj(
                {"model": model, "prompt": STR, "messages": _arr(OBJ, 1), "add_special_tokens": BOOL},
                ["model"],
            ),
        ),
        "/detokenize": _post(
            "openai",
            "token ids back to text",
            _obj({"model": model, "tokens": _arr(_int(0))}, ["model", "tokens"]),
        ),
        "/metrics": _get("openai", "Prometheus metrics", "text/plain"),
        "/openapi.json": _get("openai", "this document"),
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "turbospark", "version": __version__},
        "servers": [{"url": "/"}],
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            }
        },
        "security": [{"bearer": []}, {"x-api-key": []}, *([] if requires_key else [{}])],
        "paths": paths,
    }


async def openapi_json(request: Request) -> Response:
    state = state_of(request)
    return JSONResponse(openapi_document(state.registry, requires_key=bool(state.api_keys)))


def routes() -> list[Route]:
    return [Route("/openapi.json", endpoint(openai_error)(openapi_json), methods=["GET"])]
