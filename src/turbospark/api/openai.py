"""OpenAI wire format: /v1/chat/completions, /v1/completions, /v1/models.

Parses bodies into `ChatRequest` and renders events back as OpenAI JSON or SSE chunks. Chunks
are built as plain dicts and serialized with orjson: this is the per-token hot path.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from turbospark.api import fields as f
from turbospark.api.common import (
    endpoint,
    model_kinds,
    new_id,
    prime,
    read_json,
    retry_headers,
    sse_response,
    state_of,
    until_disconnect,
    until_shutdown,
)
from turbospark.backend import ReasoningEffort
from turbospark.errors import ApiError, ErrorKind, invalid
from turbospark.events import (
    Event,
    Finish,
    Ping,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)
from turbospark.generate import run_choice, stream_choice
from turbospark.plan import Plan, make_plan
from turbospark.request import (
    ChatRequest,
    Message,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
)

_ERROR_TYPES = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.PERMISSION: "permission_error",
    ErrorKind.NOT_FOUND: "invalid_request_error",
    ErrorKind.TOO_LARGE: "invalid_request_error",
    ErrorKind.OVERLOADED: "rate_limit_error",
    ErrorKind.UNAVAILABLE: "server_error",
    ErrorKind.INTERNAL: "server_error",
}
_ERROR_CODES = {ErrorKind.NOT_FOUND: "model_not_found", ErrorKind.AUTHENTICATION: "invalid_api_key"}


def error_body(exc: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": exc.message,
            "type": _ERROR_TYPES[exc.kind],
            "param": exc.param,
            "code": _ERROR_CODES.get(exc.kind),
        }
    }


def render_error(exc: ApiError) -> Response:
    return JSONResponse(error_body(exc), status_code=exc.status, headers=retry_headers(exc))


# ---------------------------------------------------------------- parsing


_EFFORTS = {
    "none": ReasoningEffort.OFF,
    "minimal": ReasoningEffort.LOW,
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
    "xhigh": ReasoningEffort.HIGH,
}


def parse_effort(value: Any, where: str) -> ReasoningEffort | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in _EFFORTS:
        raise invalid(f"'{where}' must be one of {', '.join(_EFFORTS)}, got {value!r}", where)
    return _EFFORTS[value]


def _content_text_and_images(content: Any, where: str, msg: Message) -> None:
    if content is None:
        return
    if isinstance(content, str):
        msg.content = content
        return
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or an array of content parts", where)
    texts: list[str] = []
    for i, part in enumerate(content):
        pw = f"{where}[{i}]"
        part = f.as_object(part, pw)
        kind = f.string(part, "type", f"{pw}.type", required=True)
        if kind in ("text", "input_text", "output_text"):
            texts.append(f.string(part, "text", f"{pw}.text", required=True) or "")
        elif kind == "image_url":
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise invalid(f"'{pw}.image_url.url' must be a string", f"{pw}.image_url")
            msg.images.append(f.decode_base64_image(url, f"{pw}.image_url.url"))
        elif kind == "refusal":
            texts.append(f.string(part, "refusal", f"{pw}.refusal") or "")
        else:
            raise invalid(f"'{pw}.type' {kind!r} is not supported; use 'text' or 'image_url'", f"{pw}.type")
    msg.content = "".join(texts)


def parse_tool_calls(raw: Any, where: str) -> list[ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid(f"'{where}' must be an array", where)
    calls = []
    for i, item in enumerate(raw):
        iw = f"{where}[{i}]"
        item = f.as_object(item, iw)
        fn = f.obj(item, "function", f"{iw}.function", required=True) or {}
        name = f.string(fn, "name", f"{iw}.function.name", required=True) or ""
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = orjson.dumps(args).decode()
        elif not isinstance(args, str):
            raise invalid(f"'{iw}.function.arguments' must be a JSON string", f"{iw}.function.arguments")
        calls.append(
            ToolCall(id=f.string(item, "id", f"{iw}.id") or new_id("call_"), name=name, arguments=args)
        )
    return calls


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def parse_messages(raw: Any) -> list[Message]:
    if raw is None:
        raise invalid("'messages' is required", "messages")
    if not isinstance(raw, list):
        raise invalid("'messages' must be an array", "messages")
    if not raw:
        raise invalid("'messages' must contain at least one message", "messages")
    out = []
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        item = f.as_object(item, where)
        role = f.string(item, "role", f"{where}.role", required=True)
        if role not in _ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
        msg = Message(role="tool" if role == "function" else role)  # type: ignore[arg-type]
        _content_text_and_images(item.get("content"), f"{where}.content", msg)
        if role == "assistant":
            msg.tool_calls = parse_tool_calls(item.get("tool_calls"), f"{where}.tool_calls")
            reasoning = item.get("reasoning_content", item.get("reasoning"))
            msg.reasoning = reasoning if isinstance(reasoning, str) else None
        elif item.get("content") is None:
            raise invalid(f"'{where}.content' is required for role {role!r}", f"{where}.content")
        if role == "tool":
            msg.tool_call_id = f.string(item, "tool_call_id", f"{where}.tool_call_id")
        msg.name = f.string(item, "name", f"{where}.name")
        out.append(msg)
    return out


def parse_tools(raw: Any) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("'tools' must be an array", "tools")
    tools = []
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        item = f.as_object(item, where)
        kind = item.get("type", "function")
        if kind != "function":
            raise invalid(f"'{where}.type' must be 'function', got {kind!r}", f"{where}.type")
        fn = f.obj(item, "function", f"{where}.function", required=True) or {}
        name = f.string(fn, "name", f"{where}.function.name", required=True) or ""
        params = f.obj(fn, "parameters", f"{where}.function.parameters") or {
            "type": "object",
            "properties": {},
        }
        tools.append(
            Tool(
                name=name,
                description=f.string(fn, "description", f"{where}.function.description") or "",
                parameters=params,
                strict=f.boolean(fn, "strict", False, f"{where}.function.strict"),
            )
        )
    return tools


def parse_tool_choice(raw: Any, tools: list[Tool]) -> ToolChoice:
    if raw is None:
        return ToolChoice()
    if isinstance(raw, str):
        modes = {
            "auto": ToolChoiceMode.AUTO,
            "none": ToolChoiceMode.NONE,
            "required": ToolChoiceMode.REQUIRED,
        }
        if raw not in modes:
            raise invalid(
                f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {raw!r}", "tool_choice"
            )
        choice = ToolChoice(modes[raw])
    elif isinstance(raw, dict):
        fn = raw.get("function")
        name = fn.get("name") if isinstance(fn, dict) else raw.get("name")
        if not isinstance(name, str):
            raise invalid("'tool_choice.function.name' must be a string", "tool_choice")
        choice = ToolChoice(ToolChoiceMode.NAMED, name)
    else:
        raise invalid("'tool_choice' must be a string or an object", "tool_choice")
    if choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED) and not tools:
        raise invalid(f"'tool_choice' is {raw!r} but the request has no tools", "tool_choice")
    if choice.mode is ToolChoiceMode.NAMED and choice.name not in {t.name for t in tools}:
        raise invalid(f"'tool_choice' names function {choice.name!r}, which is not in 'tools'", "tool_choice")
    return choice


def parse_response_format(raw: Any) -> ResponseFormat | None:
    if raw is None:
        return None
    body = f.as_object(raw, "response_format")
    kind = f.string(body, "type", "response_format.type", required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = f.obj(body, "json_schema", "response_format.json_schema", required=True) or {}
        schema = f.obj(spec, "schema", "response_format.json_schema.schema") or {}
        return ResponseFormat(
            "json_schema",
            schema=schema,
            name=f.string(spec, "name", "response_format.json_schema.name"),
            strict=f.boolean(spec, "strict", False, "response_format.json_schema.strict"),
        )
    raise invalid(
        f"'response_format.type' must be text, json_object or json_schema, got {kind!r}",
        "response_format.type",
    )


def parse_logit_bias(raw: Any) -> dict[int, float]:
    if raw is None:
        return {}
    body = f.as_object(raw, "logit_bias")
    out = {}
    for key, value in body.items():
        try:
            token_id = int(key)
        except ValueError:
            raise invalid(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise invalid(f"'logit_bias[{key}]' must be a number from -100 to 100", "logit_bias")
        out[token_id] = float(value)
    return out


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    sp = SamplingParams()
    temperature = f.number(body, "temperature", minimum=0.0, maximum=2.0)
    sp.temperature = 1.0 if temperature is None else temperature
    top_p = f.number(body, "top_p", minimum=0.0, maximum=1.0)
    sp.top_p = 1.0 if top_p is None else top_p
    sp.top_k = max(0, f.integer(body, "top_k", minimum=-1) or 0)
    sp.min_p = f.number(body, "min_p", minimum=0.0, maximum=1.0) or 0.0
    sp.presence_penalty = f.number(body, "presence_penalty", minimum=-2.0, maximum=2.0) or 0.0
    sp.frequency_penalty = f.number(body, "frequency_penalty", minimum=-2.0, maximum=2.0) or 0.0
    rep = f.number(body, "repetition_penalty", minimum=0.01, maximum=10.0)
    sp.repetition_penalty = 1.0 if rep is None else rep
    sp.seed = f.integer(body, "seed")
    sp.logit_bias = parse_logit_bias(body.get("logit_bias"))
    return sp


def _max_tokens(body: dict[str, Any]) -> int | None:
    a = f.integer(body, "max_completion_tokens", minimum=1)
    b = f.integer(body, "max_tokens", minimum=1)
    return a if a is not None else b


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = f.boolean(body, "stream", False)
    options = f.obj(body, "stream_options")
    if options is not None and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    include_usage = f.boolean(options or {}, "include_usage", False, "stream_options.include_usage")
    return stream, include_usage


def parse_chat_request(body: dict[str, Any]) -> tuple[ChatRequest, bool]:
    model = f.string(body, "model", required=True) or ""
    messages = parse_messages(body.get("messages"))
    stream, include_usage = _stream_flags(body)
    tools = parse_tools(body.get("tools"))
    sampling = parse_sampling(body)
    sampling.logprobs = f.boolean(body, "logprobs", False)
    top = f.integer(body, "top_logprobs", minimum=0, maximum=20)
    if top is not None and not sampling.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    sampling.top_logprobs = top or 0
    request = ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=parse_tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=f.boolean(body, "parallel_tool_calls", True),
        response_format=parse_response_format(body.get("response_format")),
        sampling=sampling,
        max_tokens=_max_tokens(body),
        stop=f.stop_list(body, "stop"),
        stream=stream,
        n=f.integer(body, "n", minimum=1, maximum=16) or 1,
        reasoning_effort=parse_effort(body.get("reasoning_effort"), "reasoning_effort"),
    )
    if request.tool_choice.mode is ToolChoiceMode.NONE:
        request.tools = []
    return request, include_usage


# ---------------------------------------------------------------- rendering


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
    }


def finish_reason(finish: Finish) -> str:
    return "stop" if finish.reason == "cancelled" else finish.reason


def _logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.token.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, _, v in lp.top],
    }


class ChoiceAccumulator:
    """Collects one choice's events into a non-streaming message."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] = []
        self.finish: Finish | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, TextDelta):
            self.text.append(event.text)
            if event.logprobs:
                self.logprobs.extend(_logprob_entry(lp) for lp in event.logprobs)
        elif isinstance(event, ReasoningDelta):
            self.reasoning.append(event.text)
        elif isinstance(event, ToolCallStart):
            self.calls.append(
                {"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
            )
        elif isinstance(event, ToolCallArgs):
            self.calls[event.index]["function"]["arguments"] += event.delta
        elif isinstance(event, Finish):
            self.finish = event


def _chat_choice(index: int, acc: ChoiceAccumulator, want_logprobs: bool) -> dict[str, Any]:
    assert acc.finish is not None
    text = "".join(acc.text)
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not acc.calls else None}
    if acc.reasoning:
        message["reasoning_content"] = "".join(acc.reasoning)
    if acc.calls:
        message["tool_calls"] = acc.calls
    return {
        "index": index,
        "message": message,
        "logprobs": {"content": acc.logprobs} if want_logprobs else None,
        "finish_reason": finish_reason(acc.finish),
    }


def _sum_usage(finishes: list[Finish]) -> Usage:
    total = Usage(
        prompt_tokens=finishes[0].usage.prompt_tokens, cached_tokens=finishes[0].usage.cached_tokens
    )
    for fin in finishes:
        total.completion_tokens += fin.usage.completion_tokens
        total.reasoning_tokens += fin.usage.reasoning_tokens
    return total


async def chat_completions(request: Request) -> Response:
    body = await read_json(request)
    chat, include_usage = parse_chat_request(body)
    plan = make_plan(chat, state_of(request).registry)
    ident = new_id("chatcmpl-")
    created = int(time.time())
    if chat.stream:
        return await _stream_chat(request, plan, ident, created, include_usage)

    async def collect() -> list[ChoiceAccumulator]:
        accs = []
        for i in range(chat.n):
            acc = ChoiceAccumulator()
            for event in await run_choice(plan, i):
                acc.add(event)
            accs.append(acc)
        return accs

    accs = await until_disconnect(request, collect())
    finishes = [a.finish for a in accs if a.finish is not None]
    return Response(
        orjson.dumps(
            {
                "id": ident,
                "object": "chat.completion",
                "created": created,
                "model": chat.model,
                "system_fingerprint": "turbospark",
                "choices": [_chat_choice(i, a, chat.sampling.logprobs) for i, a in enumerate(accs)],
                "usage": usage_dict(_sum_usage(finishes)),
            }
        ),
        media_type="application/json",
    )


async def _stream_chat(
    request: Request, plan: Plan, ident: str, created: int, include_usage: bool
) -> Response:
    chat = plan.request
    ping = state_of(request).ping_interval
    head = {"id": ident, "object": "chat.completion.chunk", "created": created, "model": chat.model}
    head["system_fingerprint"] = "turbospark"
    usage_null = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return b"data: " + orjson.dumps({**head, "choices": [choice], **usage_null}) + b"\n\n"

    first, events = await prime(request, stream_choice(plan, 0, ping))

    async def body() -> AsyncIterator[bytes]:
        finishes: list[Finish] = []
        for i in range(chat.n):
            stream = events if i == 0 else until_shutdown(request, stream_choice(plan, i, ping))
            pending = [first] if i == 0 and first is not None else []
            yield chunk(i, {"role": "assistant", "content": ""})
            try:
                async for event in _chain(pending, stream):
                    if isinstance(event, TextDelta):
                        lp = (
                            {"content": [_logprob_entry(x) for x in event.logprobs]}
                            if event.logprobs
                            else None
                        )
                        if event.text or lp:
                            yield chunk(i, {"content": event.text}, logprobs=lp)
                    elif isinstance(event, ReasoningDelta):
                        yield chunk(i, {"reasoning_content": event.text})
                    elif isinstance(event, ToolCallStart):
                        call = {"index": event.index, "id": event.id, "type": "function"}
                        call["function"] = {"name": event.name, "arguments": ""}
                        yield chunk(i, {"tool_calls": [call]})
                    elif isinstance(event, ToolCallArgs):
                        yield chunk(
                            i,
                            {"tool_calls": [{"index": event.index, "function": {"arguments": event.delta}}]},
                        )
                    elif isinstance(event, Finish):
                        finishes.append(event)
                        yield chunk(i, {}, finish_reason(event))
                    elif isinstance(event, Ping):
                        yield b": ping\n\n"
            except ApiError as exc:
                yield b"data: " + orjson.dumps(error_body(exc)) + b"\n\n"
                return
        if include_usage and finishes:
            final = {**head, "choices": [], "usage": usage_dict(_sum_usage(finishes))}
            yield b"data: " + orjson.dumps(final) + b"\n\n"
        yield b"data: [DONE]\n\n"

    return sse_response(body())


async def _chain(first: list[Event], rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    for event in first:
        yield event
    async for event in rest:
        yield event


# ---------------------------------------------------------------- /v1/completions


def _prompt_text(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        return raw[0]
    if isinstance(raw, list) and len(raw) > 1:
        raise invalid("'prompt' with several prompts is not supported; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a string", "prompt")


async def completions(request: Request) -> Response:
    body = await read_json(request)
    model = f.string(body, "model", required=True) or ""
    prompt = _prompt_text(f.req(body, "prompt"))
    stream, include_usage = _stream_flags(body)
    sampling = parse_sampling(body)
    num_logprobs = f.integer(body, "logprobs", minimum=0, maximum=5)
    if num_logprobs is not None:
        sampling.logprobs, sampling.top_logprobs = True, num_logprobs
    max_tokens = f.integer(body, "max_tokens", minimum=1)
    chat = ChatRequest(
        model=model,
        messages=[],
        prompt=prompt,
        sampling=sampling,
        max_tokens=16 if max_tokens is None else max_tokens,
        stop=f.stop_list(body, "stop"),
        stream=stream,
        n=f.integer(body, "n", minimum=1, maximum=16) or 1,
    )
    echo = f.boolean(body, "echo", False)
    plan = make_plan(chat, state_of(request).registry)
    ident = new_id("cmpl-")
    created = int(time.time())
    head = {"id": ident, "object": "text_completion", "created": created, "model": model}

    def logprobs_obj(entries: list[TokenLogprob]) -> dict[str, Any]:
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t: v for t, _, v in e.top} for e in entries],
            "text_offset": [],
        }

    if not stream:

        async def collect() -> list[tuple[str, list[TokenLogprob], Finish]]:
            out = []
            for i in range(chat.n):
                text, lps, fin = [], [], None
                for event in await run_choice(plan, i):
                    if isinstance(event, TextDelta | ReasoningDelta):
                        text.append(event.text)
                        if isinstance(event, TextDelta) and event.logprobs:
                            lps.extend(event.logprobs)
                    elif isinstance(event, Finish):
                        fin = event
                assert fin is not None
                out.append(((prompt if echo else "") + "".join(text), lps, fin))
            return out

        results = await until_disconnect(request, collect())
        choices = [
            {
                "index": i,
                "text": text,
                "logprobs": logprobs_obj(lps) if sampling.logprobs else None,
                "finish_reason": finish_reason(fin),
            }
            for i, (text, lps, fin) in enumerate(results)
        ]
        usage = usage_dict(_sum_usage([fin for _, _, fin in results]))
        return Response(
            orjson.dumps({**head, "choices": choices, "usage": usage}), media_type="application/json"
        )

    ping = state_of(request).ping_interval
    first, events = await prime(request, stream_choice(plan, 0, ping))

    async def body_stream() -> AsyncIterator[bytes]:
        finishes = []
        usage_null = {"usage": None} if include_usage else {}
        for i in range(chat.n):
            stream_i = events if i == 0 else until_shutdown(request, stream_choice(plan, i, ping))
            pending = [first] if i == 0 and first is not None else []
            if echo:
                choice = {"index": i, "text": prompt, "logprobs": None, "finish_reason": None}
                yield b"data: " + orjson.dumps({**head, "choices": [choice], **usage_null}) + b"\n\n"
            try:
                async for event in _chain(pending, stream_i):
                    if isinstance(event, TextDelta | ReasoningDelta):
                        lps = event.logprobs if isinstance(event, TextDelta) else None
                        choice = {
                            "index": i,
                            "text": event.text,
                            "logprobs": logprobs_obj(lps) if lps else None,
                            "finish_reason": None,
                        }
                        yield b"data: " + orjson.dumps({**head, "choices": [choice], **usage_null}) + b"\n\n"
                    elif isinstance(event, Finish):
                        finishes.append(event)
                        choice = {
                            "index": i,
                            "text": "",
                            "logprobs": None,
                            "finish_reason": finish_reason(event),
                        }
                        yield b"data: " + orjson.dumps({**head, "choices": [choice], **usage_null}) + b"\n\n"
                    elif isinstance(event, Ping):
                        yield b": ping\n\n"
            except ApiError as exc:
                yield b"data: " + orjson.dumps(error_body(exc)) + b"\n\n"
                return
        if include_usage and finishes:
            yield (
                b"data: "
                + orjson.dumps({**head, "choices": [], "usage": usage_dict(_sum_usage(finishes))})
                + b"\n\n"
            )
        yield b"data: [DONE]\n\n"

    return sse_response(body_stream())


# ---------------------------------------------------------------- /v1/models


def model_entry(model_id: str, created: int, kinds: Sequence[str] = ("completion",)) -> dict[str, Any]:
    """One shape both SDKs parse: OpenAI's fields plus Anthropic's (type, display_name, created_at),
    and `capabilities` (["completion"], ["embedding"] or both) for clients that pick an embedder."""
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
    named = [(name, b) for b in registry.backends() for name in (b.model_id, *b.aliases())]
    ids = [name for name, _ in named]
    data = [model_entry(name, registry.created, model_kinds(b)) for name, b in named]
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
    backend = registry.lookup(name)
    if backend is None:
        raise ApiError(ErrorKind.NOT_FOUND, f"model {name!r} not found", param="model")
    return JSONResponse(model_entry(name, registry.created, model_kinds(backend)))


def routes() -> list[Route]:
    wrap = endpoint(render_error)
    return [
        Route("/v1/chat/completions", wrap(chat_completions), methods=["POST"]),
        Route("/v1/completions", wrap(completions), methods=["POST"]),
        Route("/v1/models", wrap(list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", wrap(get_model), methods=["GET"]),
    ]
