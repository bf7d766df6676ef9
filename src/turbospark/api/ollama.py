"""Ollama wire format: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/pull,
/api/delete, /api/copy, /api/create, /api/version, `/`.

Bodies parse into `ChatRequest`; events render back as Ollama JSON objects, one per line
(NDJSON) when streaming, which is Ollama's default (`stream` absent means true). The last line
has `done: true`, a `done_reason`, token counts and durations in nanoseconds. Errors are
`{"error": "..."}` with the HTTP status, or one such line if a stream already started.

Ollama specifics kept here: tool-call `arguments` are JSON objects (not strings), a tool call is
sent whole once complete (never as argument fragments), tool results carry `tool_name`, reasoning
goes to `thinking` (never into the answer), and model names are `name:tag` (the registry drops
`:latest`; `/api/tags` lists `<id>:latest`). An empty `messages` / `prompt` is Ollama's "load
the model" request and answers `done_reason: "load"` (or "unload" with `keep_alive: 0`).

`keep_alive` is Ollama's (seconds or a duration; 0 unloads once the reply is done, negative
pins; absent: the server's `--keep-alive`), applied by the registry. The store's routes:
`/api/pull` (progress lines from `engine.pull.pull_steps`), `/api/delete`, `/api/copy` (a
name kept on disk) and `/api/create` with only `from` (a copy; anything more is refused by name).

Accepted and not applied: `options.num_ctx` (the context is fixed when the model loads), plus
Ollama's runner options (num_gpu, num_thread, mirostat, ...). Refused with a 400: `suffix`,
`template`, a non-empty `context`, and `images` or `system` together with `raw: true`.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from turbospark.api import fields as f
from turbospark.api.common import cache_salt, endpoint, read_json, state_of
from turbospark.api.envelopes import ollama_error, ollama_error_body
from turbospark.api.kit import (
    NDJSON,
    collect,
    logprob_entries,
    ndjson_line,
    ndjson_response,
    start_stream,
    tool_arguments,
)
from turbospark.api.parsing import parse_function_tools, parse_tool_calls
from turbospark.backend import Backend, ChatModel, Embedder, ReasoningEffort
from turbospark.chat_template import CHATML_TEMPLATE
from turbospark.errors import ApiError, ErrorKind, invalid
from turbospark.events import Finish, ReasoningDelta, TextDelta, TokenLogprob, ToolCallArgs, ToolCallStart
from turbospark.plan import Plan, make_plan
from turbospark.registry import ServedModel, model_kinds
from turbospark.request import ChatRequest, Message, ResponseFormat, SamplingParams, ToolCall
from turbospark.store import ModelStore

# The Ollama API level this server answers as on /api/version: tools that gate features on the
# server version (thinking, tool calls, structured outputs) see one that has them all.
OLLAMA_API_VERSION = "0.13.0"

CALL_PREFIX = "call_"


def created_at() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# ---------------------------------------------------------------- parsing


_THINK_LEVELS = {"low": ReasoningEffort.LOW, "medium": ReasoningEffort.MEDIUM, "high": ReasoningEffort.HIGH}


def parse_think(raw: Any) -> ReasoningEffort | None:
    """`think`: true/false, or a level. True asks for thinking at medium effort."""
    if raw is None:
        return None
    if raw is True:
        return ReasoningEffort.MEDIUM
    if raw is False:
        return ReasoningEffort.OFF
    if isinstance(raw, str) and raw in _THINK_LEVELS:
        return _THINK_LEVELS[raw]
    raise invalid(f"'think' must be true, false, 'low', 'medium' or 'high', got {raw!r}", "think")


def parse_format(raw: Any) -> ResponseFormat | None:
    """`format`: "json" (any JSON object) or a JSON schema the reply must follow."""
    if raw is None or raw == "":
        return None
    if raw == "json":
        return ResponseFormat("json_object")
    if isinstance(raw, dict):
        return ResponseFormat("json_schema", schema=raw, strict=True)
    raise invalid(f"'format' must be \"json\" or a JSON schema object, got {raw!r}", "format")


_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(raw: Any) -> float | None:
    """Seconds (a number, or a Go duration like "5m" / "1h30m"; negative means forever)."""
    if raw is None:
        return None
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(raw, str):
        text = raw.strip()
        try:
            return float(text)
        except ValueError:
            pass
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        parts = _DURATION_PART.findall(body)
        if parts and "".join(n + u for n, u in parts) == body:
            return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    raise invalid(
        f"'keep_alive' must be a number of seconds or a duration like \"5m\", got {raw!r}", "keep_alive"
    )


def parse_options(body: dict[str, Any]) -> tuple[SamplingParams, int | None, list[str]]:
    """`options` -> (sampling, max_tokens, stop). Runner options Ollama has are accepted."""
    opts = f.obj(body, "options") or {}

    def where(key: str) -> str:
        return f"options.{key}"

    # An option left out (or null) is None: the served model's default (see request.py).
    sp = SamplingParams()
    sp.temperature = f.number(opts, "temperature", where("temperature"), minimum=0.0)
    sp.top_p = f.number(opts, "top_p", where("top_p"), minimum=0.0, maximum=1.0)
    top_k = f.integer(opts, "top_k", where("top_k"), minimum=-1)
    sp.top_k = None if top_k is None else max(0, top_k)  # llama.cpp: top_k <= 0 is off
    sp.min_p = f.number(opts, "min_p", where("min_p"), minimum=0.0, maximum=1.0)
    seed = f.integer(opts, "seed", where("seed"), minimum=-(2**63), maximum=2**63 - 1)
    sp.seed = seed if seed is not None and seed >= 0 else None  # Ollama: -1 is a random seed
    repeat = f.number(opts, "repeat_penalty", where("repeat_penalty"), minimum=0.0, maximum=10.0)
    # 1.0 is off; llama.cpp treats 0 as off too rather than dividing logits by zero.
    sp.repetition_penalty = None if repeat is None else repeat or 1.0
    sp.presence_penalty = (
        f.number(opts, "presence_penalty", where("presence_penalty"), minimum=-2.0, maximum=2.0) or 0.0
    )
    sp.frequency_penalty = (
        f.number(opts, "frequency_penalty", where("frequency_penalty"), minimum=-2.0, maximum=2.0) or 0.0
    )
    f.integer(opts, "num_ctx", where("num_ctx"), minimum=1)  # validated, not applied (see docstring)

    num_predict = f.integer(opts, "num_predict", where("num_predict"), minimum=-2)
    if num_predict == 0:
        raise invalid(
            "'options.num_predict' must be a positive number of tokens, "
            "-1 (no limit) or -2 (fill the context)",
            where("num_predict"),
        )
    max_tokens = num_predict if num_predict is not None and num_predict > 0 else None

    stop = opts.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise invalid("'options.stop' must be a string or an array of strings", where("stop"))

    sp.logprobs = f.boolean(body, "logprobs", False)
    top = f.integer(body, "top_logprobs", minimum=0, maximum=20)
    if top:
        sp.logprobs = True
    sp.top_logprobs = top or 0
    return sp, max_tokens, stops


def _images(raw: Any, where: str) -> list[Any]:
    items = raw if raw is not None else []
    if not isinstance(items, list):
        raise invalid(f"'{where}' must be an array of base64 strings", where)
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise invalid(f"'{where}[{i}]' must be a base64 string", f"{where}[{i}]")
        out.append(f.decode_base64_image(item, f"{where}[{i}]"))
    return out


_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(raw: Any) -> list[Message]:
    out = []
    for where, item in f.objects(raw, "messages"):
        role = f.string(item, "role", f"{where}.role", required=True)
        if role not in _ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
        msg = Message(role=role)  # type: ignore[arg-type]
        msg.content = f.string(item, "content", f"{where}.content") or ""
        msg.images = _images(item.get("images"), f"{where}.images")
        if role == "assistant":
            # Ollama's history has no call ids: number the calls, as Ollama does.
            msg.tool_calls = parse_tool_calls(
                item.get("tool_calls"), f"{where}.tool_calls", lambda i: f"call_{i}"
            )
            msg.reasoning = f.string(item, "thinking", f"{where}.thinking") or None
        if role == "tool":
            msg.name = f.string(item, "tool_name", f"{where}.tool_name")
            msg.tool_call_id = f.string(item, "tool_call_id", f"{where}.tool_call_id")
        out.append(msg)
    _link_tool_results(out)
    return out


def _link_tool_results(messages: list[Message]) -> None:
    """Fills each tool result's missing call id or tool name from the call it answers.

    Ollama's history names the tool (`tool_name`) but carries no call ids; OpenAI-shaped clients
    (LiteLLM) send `tool_call_id` and no name. Templates may want either, so both are filled:
    a result answers the first still-open call with its id, else with its name, else in order.
    """
    open_calls: list[ToolCall] = []
    for msg in messages:
        if msg.role == "assistant":
            open_calls = list(msg.tool_calls)
        elif msg.role == "tool" and open_calls:
            match = next((c for c in open_calls if msg.tool_call_id and c.id == msg.tool_call_id), None)
            if match is None and msg.tool_call_id is None:
                match = next((c for c in open_calls if msg.name and c.name == msg.name), open_calls[0])
            if match is not None:
                open_calls.remove(match)
                msg.tool_call_id = msg.tool_call_id or match.id
                msg.name = msg.name or match.name


def _generation_fields(body: dict[str, Any]) -> dict[str, Any]:
    """What /api/chat and /api/generate share, as `ChatRequest` keyword arguments."""
    sampling, max_tokens, stop = parse_options(body)
    return {
        "model": f.string(body, "model", required=True) or "",
        "response_format": parse_format(body.get("format")),
        "sampling": sampling,
        "max_tokens": max_tokens,
        "stop": stop,
        "stream": f.boolean(body, "stream", True),
        "reasoning_effort": parse_think(body.get("think")),
    }


def parse_chat_request(body: dict[str, Any]) -> tuple[ChatRequest, float | None]:
    request = ChatRequest(
        messages=parse_messages(body.get("messages")),
        tools=parse_function_tools(body.get("tools"), nested=True),
        **_generation_fields(body),
    )
    return request, parse_keep_alive(body.get("keep_alive"))


def parse_generate_request(body: dict[str, Any]) -> tuple[ChatRequest, float | None]:
    prompt = f.string(body, "prompt") or ""
    system = f.string(body, "system")
    raw = f.boolean(body, "raw", False)
    if f.string(body, "suffix"):
        raise invalid("'suffix' (fill-in-the-middle) is not supported by this server", "suffix")
    if f.string(body, "template"):
        raise invalid(
            "'template' overrides are not supported: the model's own chat template is used "
            "(send raw: true with a ready prompt instead)",
            "template",
        )
    if f.array(body, "context"):
        raise invalid(
            "'context' is not supported by this server: keep the conversation as /api/chat messages "
            "or send the whole prompt",
            "context",
        )
    images = _images(body.get("images"), "images")
    request = ChatRequest(messages=[], **_generation_fields(body))
    if raw:
        if images:
            raise invalid("'images' cannot be sent with raw: true; send them without raw", "images")
        if system:
            raise invalid("'system' has no effect with raw: true; put it in the prompt", "system")
        if prompt:
            request.prompt = prompt
    elif prompt or images:
        if system:
            request.messages.append(Message(role="system", content=system))
        request.messages.append(Message(role="user", content=prompt, images=images))
    return request, parse_keep_alive(body.get("keep_alive"))


# ---------------------------------------------------------------- rendering


def done_reason(finish: Finish) -> str:
    # Ollama reports a reply that called tools as "stop"; a cancelled one never reaches a client.
    return "length" if finish.reason == "length" else "stop"


def _ns(seconds: float) -> int:
    return max(1, round(seconds * 1e9))


def timings(finish: Finish, started: float) -> dict[str, Any]:
    """Counts and nanosecond durations; load_duration is the time outside prefill and decode."""
    total = time.perf_counter() - started
    return {
        "total_duration": _ns(total),
        "load_duration": _ns(max(0.0, total - finish.prefill_seconds - finish.decode_seconds)),
        "prompt_eval_count": finish.usage.prompt_tokens,
        "prompt_eval_duration": _ns(finish.prefill_seconds),
        "eval_count": finish.usage.completion_tokens,
        "eval_duration": _ns(finish.decode_seconds),
    }


def _call_dict(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    # Tool parsers only emit object arguments; this guards the one contract Ollama clients
    # validate (an object), should a parser ever hand over something else.
    args = tool_arguments(arguments)
    return {
        "id": CALL_PREFIX + call_id,
        "function": {
            "index": index,
            "name": name,
            "arguments": {"arguments": arguments} if args is None else args,
        },
    }


class _Calls:
    """Tool calls assembled from start/argument events; Ollama sends each one whole."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, str, str, list[str]]] = []

    def add(self, event: ToolCallStart | ToolCallArgs) -> None:
        if isinstance(event, ToolCallStart):
            self.pending.append((event.index, event.id, event.name, []))
        else:
            for index, _, _, parts in self.pending:
                if index == event.index:
                    parts.append(event.delta)

    def take(self) -> list[dict[str, Any]]:
        done = [_call_dict(i, cid, name, "".join(parts)) for i, cid, name, parts in self.pending]
        self.pending = []
        return done


def _chat_message(
    content: str, thinking: str | None = None, calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if thinking:
        message["thinking"] = thinking
    if calls:
        message["tool_calls"] = calls
    return message


def _load_reply(model: str, keep_alive: float | None, chat: bool) -> dict[str, Any]:
    reply: dict[str, Any] = {"model": model, "created_at": created_at()}
    if chat:
        reply["message"] = {"role": "assistant", "content": ""}
    else:
        reply["response"] = ""
    reply["done_reason"] = "unload" if keep_alive == 0 else "load"
    reply["done"] = True
    return reply


def _respond(reply: dict[str, Any], stream: bool) -> Response:
    data = orjson.dumps(reply)
    return (
        Response(data + b"\n", media_type=NDJSON) if stream else Response(data, media_type="application/json")
    )


def _reply(
    model: str,
    chat_api: bool,
    content: str = "",
    thinking: str | None = None,
    calls: list[dict[str, Any]] | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> dict[str, Any]:
    """One reply object (a whole reply, or one line of a stream), `done` still to be set."""
    reply: dict[str, Any] = {"model": model, "created_at": created_at()}
    if chat_api:
        reply["message"] = _chat_message(content, thinking, calls)
    else:
        reply["response"] = content
        if thinking:
            reply["thinking"] = thinking
    if logprobs is not None:
        reply["logprobs"] = logprob_entries(logprobs)
    return reply


def _done(reply: dict[str, Any], finish: Finish, started: float) -> dict[str, Any]:
    return reply | {"done": True, "done_reason": done_reason(finish), **timings(finish, started)}


async def _generate(request: Request, chat_api: bool) -> Response:
    started = time.perf_counter()
    body = await read_json(request)
    parse = parse_chat_request if chat_api else parse_generate_request
    chat, keep_alive = parse(body)
    registry = state_of(request).registry
    if not chat.messages and chat.prompt is None:
        if keep_alive == 0:  # unload: a model that is not loaded stays so
            loaded = registry.lookup(chat.model)
            if loaded is not None:
                registry.set_keep_alive(loaded, 0)
                registry.unload(loaded)  # not while sequences run: the reaper does, once they end
            elif not registry.loadable(chat.model):
                registry.resolve(chat.model)  # an unknown model is still a 404
        else:
            registry.set_keep_alive(registry.resolve(chat.model), keep_alive)  # loads it
        return _respond(_load_reply(chat.model, keep_alive, chat_api), chat.stream)
    chat.cache_salt = cache_salt(request, body)
    plan = make_plan(chat, registry)
    served = registry.lookup(chat.model)
    if served is not None and served.backend is plan.backend:
        registry.set_keep_alive(served, keep_alive)
    if chat.stream:
        return await _stream(request, plan, started, chat_api)

    (choice,) = await collect(request, plan)
    calls = [_call_dict(i, c.id, c.name, c.arguments) for i, c in enumerate(choice.calls)]
    logprobs = choice.logprobs if chat.sampling.logprobs else None
    reply = _reply(chat.model, chat_api, choice.text, choice.reasoning, calls, logprobs)
    return Response(orjson.dumps(_done(reply, choice.finish, started)), media_type="application/json")


async def _stream(request: Request, plan: Plan, started: float, chat_api: bool) -> Response:
    model = plan.request.model
    events = await start_stream(request, plan)

    def line(**parts: Any) -> bytes:
        return ndjson_line(_reply(model, chat_api, **parts) | {"done": False})

    async def body() -> AsyncIterator[bytes]:
        calls = _Calls()
        try:
            async for event in events:
                if isinstance(event, TextDelta):
                    if event.text or event.logprobs:
                        yield line(content=event.text, logprobs=event.logprobs or None)
                elif isinstance(event, ReasoningDelta):
                    yield line(thinking=event.text)
                elif isinstance(event, ToolCallStart):
                    if calls.pending:  # the previous call is complete
                        yield line(calls=calls.take())
                    calls.add(event)
                elif isinstance(event, ToolCallArgs):
                    calls.add(event)
                elif isinstance(event, Finish):
                    if calls.pending:
                        yield line(calls=calls.take())
                    yield ndjson_line(_done(_reply(model, chat_api), event, started))
        except ApiError as exc:
            yield ndjson_line(ollama_error_body(exc))

    return ndjson_response(body())


async def chat(request: Request) -> Response:
    return await _generate(request, chat_api=True)


async def generate(request: Request) -> Response:
    return await _generate(request, chat_api=False)


# ---------------------------------------------------------------- models


def ollama_name(model_id: str) -> str:
    """The name Ollama clients list and send back: `<id>:latest` unless the id has a tag."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else f"{model_id}:latest"


def _rfc3339(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, UTC).isoformat().replace("+00:00", "Z")


def _parameter_size(num: int) -> str:
    if num <= 0:
        return ""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if num >= scale:
            return f"{num / scale:.1f}{unit}"
    return str(num)


def model_details(backend: Backend) -> dict[str, Any]:
    """Ollama's `details`, from the backend's `ModelDetails` (unknown facts are left empty)."""
    facts = backend.details()
    return {
        "parent_model": "",
        "format": facts.format,
        "family": facts.family,
        "families": [facts.family] if facts.family else None,
        "parameter_size": _parameter_size(facts.num_parameters),
        "quantization_level": facts.quantization,
    }


def _digest(model_id: str) -> str:
    return hashlib.sha256(model_id.encode()).hexdigest()


def capabilities(backend: Backend) -> list[str]:
    if not isinstance(backend, ChatModel):
        return model_kinds(backend)  # an embedding model: ["embedding"]
    tokenizer = backend.tokenizer
    template = tokenizer.chat_template or ""
    caps = ["completion"]
    if not tokenizer.chat_template or "tools" in template:  # no template: the built-in one has tools
        caps.append("tools")
    if tokenizer.token_to_id("<think>") is not None or "<think>" in template:
        caps.append("thinking")
    if backend.vision() is not None:
        caps.append("vision")
    if isinstance(backend, Embedder):
        caps.append("embedding")
    return caps


def _listing(backend: Backend) -> dict[str, Any]:
    """The fields /api/tags and /api/ps both list for a model."""
    name = ollama_name(backend.model_id)
    return {
        "name": name,
        "model": name,
        "size": backend.details().size_bytes,
        "digest": _digest(backend.model_id),
        "details": model_details(backend),
    }


async def tags(request: Request) -> Response:
    """Every model this server can serve, loaded or not (the store's, with file sizes and
    times), and loaded ones the store does not list."""
    registry = state_of(request).registry
    modified = _rfc3339(registry.created)
    models = []
    listed: set[str] = set()
    for entry in registry.store.entries() if registry.store is not None else []:
        loaded = registry.lookup(entry.name)
        name = ollama_name(entry.name)
        item: dict[str, Any] = {
            "name": name,
            "model": name,
            "modified_at": _rfc3339(entry.modified) if entry.modified else modified,
            "size": entry.size,
            "digest": entry.digest(),
        }
        if loaded is not None:
            item["details"] = model_details(loaded.backend)
            item["capabilities"] = capabilities(loaded.backend)
            listed.add(loaded.model_id)
        else:
            item["details"] = {
                "parent_model": "",
                "format": entry.format,
                "family": entry.family,
                "families": [entry.family] if entry.family else None,
                "parameter_size": "",
                "quantization_level": "",
            }
            item["capabilities"] = entry.kinds
        models.append(item)
    models += [
        _listing(b) | {"modified_at": modified, "capabilities": capabilities(b)}
        for b in registry.backends()
        if b.model_id not in listed
    ]
    return JSONResponse({"models": models})


_FOREVER = timedelta(days=365 * 100)  # Ollama shows a pinned model's expiry as a far-off date


async def ps(request: Request) -> Response:
    """The loaded models, with when each unloads if no request comes (`expires_at`)."""
    registry = state_of(request).registry
    models = []
    for served in registry.served():
        b = served.backend
        expires = registry.expires_at(served)
        when = (datetime.now(UTC) + _FOREVER).timestamp() if expires is None else expires
        models.append(
            _listing(b)
            | {
                "name": ollama_name(served.store_name or b.model_id),
                "model": ollama_name(served.store_name or b.model_id),
                "expires_at": _rfc3339(when),
                "size_vram": 0 if b.details().device == "cpu" else b.details().size_bytes,
                "context_length": b.max_context,
            }
        )
    return JSONResponse({"models": models})


def _modelfile(name: str, served: ServedModel, template: str) -> str:
    lines = [f"# Modelfile of {name}, as served by turbospark", f"FROM {served.model_id}"]
    lines.append(f'TEMPLATE """{template}"""')
    lines += [f"PARAMETER {line}" for line in _parameters(served).splitlines()]
    return "\n".join(lines) + "\n"


def _parameters(served: ServedModel) -> str:
    """The model's Modelfile parameters: its context, stop tokens and (for a model that
    generates) the sampler settings a request that leaves them out gets."""
    backend = served.backend
    tokenizer = backend.tokenizer
    lines = [f"num_ctx {backend.max_context}"]
    for token_id in sorted(tokenizer.eos_token_ids):
        token = tokenizer.id_to_token(token_id)
        if token:
            lines.append(f"stop {orjson.dumps(token).decode()}")
    if isinstance(backend, ChatModel):
        sampling = served.sampling_defaults
        for name, value in (
            ("temperature", sampling.temperature),
            ("top_k", sampling.top_k),
            ("top_p", sampling.top_p),
            ("min_p", sampling.min_p),
            ("repeat_penalty", sampling.repetition_penalty),
        ):
            if value is not None:
                lines.append(f"{name} {value:g}")
    return "\n".join(lines)


async def show(request: Request) -> Response:
    body = await read_json(request)
    # LiteLLM and older clients send `name`; current ones send `model`.
    model, name = f.string(body, "model"), f.string(body, "name")  # both checked, either used
    name = model or name
    if not name:
        raise invalid("'model' is required", "model")
    registry = state_of(request).registry
    served = registry.resolve(name)
    backend = served.backend
    template = backend.tokenizer.chat_template or CHATML_TEMPLATE
    details = model_details(backend)
    # Editors size their prompts from "<architecture>.context_length".
    arch = details["family"] or "unknown"
    info: dict[str, Any] = {
        "general.architecture": arch,
        "general.basename": backend.model_id,
        f"{arch}.context_length": backend.max_context,
        f"{arch}.vocab_size": backend.vocab_size,
    }
    if getattr(backend, "dimensions", None):
        info[f"{arch}.embedding_length"] = backend.dimensions  # type: ignore[attr-defined]
    num_parameters = backend.details().num_parameters
    if num_parameters:
        info["general.parameter_count"] = num_parameters
    return JSONResponse(
        {
            "license": "",
            "modelfile": _modelfile(ollama_name(backend.model_id), served, template),
            "parameters": _parameters(served),
            "template": template,
            "details": details,
            "model_info": info,
            "capabilities": capabilities(backend),
            "modified_at": _rfc3339(registry.created),
        }
    )


# ---------------------------------------------------------------- the store: pull, delete, copy, create


def _model_name(body: dict[str, Any]) -> str:
    # current clients send `model`, older ones `name`
    model, name = f.string(body, "model"), f.string(body, "name")
    if not (model or name):
        raise invalid("'model' is required", "model")
    return model or name or ""


def _store(request: Request) -> ModelStore:
    store = state_of(request).registry.store
    if store is None:
        raise ApiError(ErrorKind.NOT_FOUND, "this server has no model store: models are fixed at start")
    return store


async def pull_model(request: Request) -> Response:
    """Ollama's /api/pull: progress lines (NDJSON, or the last one alone with `stream: false`)."""
    from turbospark.engine.checkpoint import ModelLoadError
    from turbospark.engine.pull import PULLABLE, pull_steps

    body = await read_json(request)
    name = _model_name(body)
    stream = f.boolean(body, "stream", True)
    f.boolean(body, "insecure", False)  # accepted: there is no remote registry to trust or not
    _store(request)
    wanted = name[: -len(":latest")] if name.endswith(":latest") else name
    if wanted not in PULLABLE:
        raise ApiError(
            ErrorKind.NOT_FOUND,
            f"model {name!r} cannot be pulled; pullable: {', '.join(PULLABLE)}",
            param="model",
        )
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

    def work() -> None:
        try:
            for step in pull_steps(wanted):
                loop.call_soon_threadsafe(queue.put_nowait, step)
        except BaseException as exc:  # handed to the stream, which renders it
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=work, name=f"pull-{wanted}", daemon=True).start()

    def failure(exc: BaseException) -> ApiError:
        if isinstance(exc, ApiError):
            return exc
        if isinstance(exc, ModelLoadError):
            return ApiError(ErrorKind.INTERNAL, f"pull {name!r} failed: {exc}")
        return ApiError(ErrorKind.INTERNAL, f"pull {name!r} failed: {type(exc).__name__}: {exc}")

    if not stream:
        last: dict[str, Any] = {}
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                raise failure(item)
            last = item
        return JSONResponse(last)

    async def lines() -> AsyncIterator[bytes]:
        while (item := await queue.get()) is not None:
            if isinstance(item, BaseException):
                yield ndjson_line(ollama_error_body(failure(item)))
                return
            yield ndjson_line(item)

    return ndjson_response(lines())


async def delete_model(request: Request) -> Response:
    """Ollama's /api/delete: a copy's name, or a pulled model's file. A loaded model is unloaded
    first; one that is generating is a 409."""
    body = await read_json(request)
    name = _model_name(body)
    store = _store(request)
    registry = state_of(request).registry
    loaded = registry.lookup(name)
    if loaded is not None and not registry.unload(loaded):
        raise ApiError(
            ErrorKind.INVALID_REQUEST,
            f"model {name!r} is generating; delete it once its requests are done",
            param="model",
            status=409,
        )
    try:
        store.delete(name)
    except KeyError as exc:
        raise ApiError(ErrorKind.NOT_FOUND, str(exc.args[0]), param="model") from None
    except PermissionError as exc:
        raise ApiError(ErrorKind.INVALID_REQUEST, str(exc), param="model") from None
    return Response(status_code=200)


async def copy_model(request: Request) -> Response:
    """Ollama's /api/copy: the source model also answers to `destination` (kept on disk)."""
    body = await read_json(request)
    source = f.string(body, "source", required=True) or ""
    destination = f.string(body, "destination", required=True) or ""
    _copy(request, source, destination)
    return Response(status_code=200)


def _copy(request: Request, source: str, destination: str) -> None:
    try:
        _store(request).copy(source, destination)
    except KeyError as exc:
        raise ApiError(ErrorKind.NOT_FOUND, str(exc.args[0]), param="source") from None
    except ValueError as exc:
        raise ApiError(ErrorKind.INVALID_REQUEST, str(exc), param="destination") from None


_CREATE_UNSUPPORTED = (
    "files",
    "adapters",
    "template",
    "license",
    "system",
    "parameters",
    "messages",
    "quantize",
    "modelfile",
    "path",
)


async def create_model(request: Request) -> Response:
    """Ollama's /api/create: only the form that names an existing model under a new name
    (`from` and nothing else) is served, as a copy; everything else is refused by name."""
    body = await read_json(request)
    name = _model_name(body)
    sent = [key for key in _CREATE_UNSUPPORTED if body.get(key) not in (None, "", [], {})]
    if sent:
        raise invalid(
            f"creating models is not supported by this server ({', '.join(sent)}): put a GGUF file or a "
            "Hugging Face folder in a --model-dir folder, or copy a model under another name with "
            "/api/copy or a create with only 'from'",
            sent[0],
        )
    source = f.string(body, "from")
    if not source:
        raise invalid("'from' is required: the model to create this one from", "from")
    _copy(request, source, name)
    success = {"status": "success"}
    return _respond(success, f.boolean(body, "stream", True))


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_API_VERSION})


async def root(request: Request) -> Response:
    # Ollama's liveness answer; tools probe it (GET or HEAD) to find a running server.
    return PlainTextResponse("Ollama is running")


def routes() -> list[Route]:
    wrap = endpoint(ollama_error)
    open_ = endpoint(ollama_error, auth=False)
    return [
        Route("/", open_(root), methods=["GET", "HEAD"]),
        Route("/api/version", open_(version), methods=["GET"]),
        Route("/api/chat", wrap(chat), methods=["POST"]),
        Route("/api/generate", wrap(generate), methods=["POST"]),
        Route("/api/tags", wrap(tags), methods=["GET"]),
        Route("/api/show", wrap(show), methods=["POST"]),
        Route("/api/ps", wrap(ps), methods=["GET"]),
        Route("/api/pull", wrap(pull_model), methods=["POST"]),
        Route("/api/delete", wrap(delete_model), methods=["DELETE"]),
        Route("/api/copy", wrap(copy_model), methods=["POST"]),
        Route("/api/create", wrap(create_model), methods=["POST"]),
    ]
