"""OpenAI wire format: /v1/chat/completions and /v1/completions (`/v1/models` is `api/models.py`).

Parses bodies into `ChatRequest` and renders events back as OpenAI JSON or SSE chunks. Chunks
are built as plain dicts and serialized with orjson: this is the per-token hot path. Tool call
ids are the engine's with OpenAI's `call_` prefix.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from turbospark.api import fields as f
from turbospark.api.common import cache_salt, endpoint, new_id, read_json, sse_response, state_of
from turbospark.api.envelopes import openai_error, openai_error_body
from turbospark.api.kit import (
    SSE_DONE,
    SSE_PING,
    CollectedChoice,
    choice_streams,
    collect,
    logprob_entries,
    sse_data,
    start_stream,
    sum_usage,
)
from turbospark.api.parsing import (
    parse_chat_messages,
    parse_effort,
    parse_json_format,
    parse_temperature_top_p,
    parse_tool_fields,
)
from turbospark.errors import ApiError, invalid
from turbospark.events import (
    Finish,
    Ping,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)
from turbospark.plan import Plan, make_plan
from turbospark.request import ChatRequest, ResponseFormat, SamplingParams

CALL_PREFIX = "call_"

# ---------------------------------------------------------------- parsing


def parse_response_format(raw: Any) -> ResponseFormat | None:
    return (
        None
        if raw is None
        else parse_json_format(f.as_object(raw, "response_format"), "response_format", "json_schema")
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


# A seed is a signed 64-bit integer (as vLLM takes it); one outside is a 400, not wrapped silently.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    sp = parse_temperature_top_p(body, max_temperature=2.0)
    top_k = f.integer(body, "top_k", minimum=-1)
    sp.top_k = None if top_k is None else max(0, top_k)  # -1 (vLLM's "off") is 0
    sp.min_p = f.number(body, "min_p", minimum=0.0, maximum=1.0)
    sp.presence_penalty = f.number(body, "presence_penalty", minimum=-2.0, maximum=2.0) or 0.0
    sp.frequency_penalty = f.number(body, "frequency_penalty", minimum=-2.0, maximum=2.0) or 0.0
    sp.repetition_penalty = f.number(body, "repetition_penalty", minimum=0.01, maximum=10.0)
    sp.seed = f.integer(body, "seed", minimum=SEED_MIN, maximum=SEED_MAX)
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


def _num_choices(body: dict[str, Any]) -> int:
    return f.integer(body, "n", minimum=1, maximum=16) or 1


def parse_chat_request(body: dict[str, Any]) -> tuple[ChatRequest, bool]:
    model = f.string(body, "model") or ""  # none: the --fallback-model's, else a 400 (plan.py)
    messages = parse_chat_messages(body.get("messages"))
    stream, include_usage = _stream_flags(body)
    sampling = parse_sampling(body)
    sampling.logprobs = f.boolean(body, "logprobs", False)
    top = f.integer(body, "top_logprobs", minimum=0, maximum=20)
    if top is not None and not sampling.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    sampling.top_logprobs = top or 0
    request = ChatRequest(
        model=model,
        messages=messages,
        **parse_tool_fields(body, nested=True),
        response_format=parse_response_format(body.get("response_format")),
        sampling=sampling,
        max_tokens=_max_tokens(body),
        stop=f.stop_list(body, "stop"),
        stream=stream,
        n=_num_choices(body),
        reasoning_effort=parse_effort(body.get("reasoning_effort"), "reasoning_effort"),
    )
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


def _tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": CALL_PREFIX + call_id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _chat_choice(index: int, choice: CollectedChoice, want_logprobs: bool) -> dict[str, Any]:
    text = choice.text
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not choice.calls else None}
    if choice.reasoning:
        message["reasoning_content"] = choice.reasoning
    if choice.calls:
        message["tool_calls"] = [_tool_call(c.id, c.name, c.arguments) for c in choice.calls]
    return {
        "index": index,
        "message": message,
        "logprobs": {"content": logprob_entries(choice.logprobs)} if want_logprobs else None,
        "finish_reason": finish_reason(choice.finish),
    }


def _reply(head: dict[str, Any], choices: list[dict[str, Any]], finishes: list[Finish]) -> Response:
    body = {**head, "choices": choices, "usage": usage_dict(sum_usage(finishes))}
    return Response(orjson.dumps(body), media_type="application/json")


async def _sse_choices(
    request: Request,
    plan: Plan,
    ping: float,
    head: dict[str, Any],
    include_usage: bool,
    render: Any,
) -> Response:
    """The SSE reply shared by both endpoints: every choice in turn (`render(index, events)`
    yields its chunks), the usage chunk when asked for, then `[DONE]`; an error mid-stream is an
    error chunk."""
    first = await start_stream(request, plan, ping)

    async def body() -> AsyncIterator[bytes]:
        finishes: list[Finish] = []
        try:
            async for index, events in choice_streams(request, plan, first, ping):
                async for chunk in render(index, events, finishes):
                    yield chunk
        except ApiError as exc:
            yield sse_data(openai_error_body(exc))
            return
        if include_usage and finishes:
            yield sse_data({**head, "choices": [], "usage": usage_dict(sum_usage(finishes))})
        yield SSE_DONE

    return sse_response(body())


async def chat_completions(request: Request) -> Response:
    body = await read_json(request)
    chat, include_usage = parse_chat_request(body)
    chat.cache_salt = cache_salt(request, body)
    plan = make_plan(chat, state_of(request).registry)
    head = {"id": new_id("chatcmpl-"), "object": "chat.completion", "created": int(time.time())}
    head |= {"model": chat.model, "system_fingerprint": "turbospark"}
    if not chat.stream:
        choices = await collect(request, plan)
        rendered = [_chat_choice(i, c, chat.sampling.logprobs) for i, c in enumerate(choices)]
        return _reply(head, rendered, [c.finish for c in choices])

    head["object"] = "chat.completion.chunk"
    usage_null = {"usage": None} if include_usage else {}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return sse_data({**head, "choices": [choice], **usage_null})

    async def render(index: int, events: AsyncIterator[Any], finishes: list[Finish]) -> AsyncIterator[bytes]:
        yield chunk(index, {"role": "assistant", "content": ""})
        async for event in events:
            if isinstance(event, TextDelta):
                lp = {"content": logprob_entries(event.logprobs)} if event.logprobs else None
                if event.text or lp:
                    yield chunk(index, {"content": event.text}, logprobs=lp)
            elif isinstance(event, ReasoningDelta):
                yield chunk(index, {"reasoning_content": event.text})
            elif isinstance(event, ToolCallStart):
                call = {"index": event.index, **_tool_call(event.id, event.name, "")}
                yield chunk(index, {"tool_calls": [call]})
            elif isinstance(event, ToolCallArgs):
                call = {"index": event.index, "function": {"arguments": event.delta}}
                yield chunk(index, {"tool_calls": [call]})
            elif isinstance(event, Finish):
                finishes.append(event)
                yield chunk(index, {}, finish_reason(event))
            elif isinstance(event, Ping):
                yield SSE_PING

    return await _sse_choices(request, plan, state_of(request).ping_interval, head, include_usage, render)


# ---------------------------------------------------------------- /v1/completions


def _prompt_text(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
        return raw[0]
    if isinstance(raw, list) and len(raw) > 1:
        raise invalid("'prompt' with several prompts is not supported; send one prompt per request", "prompt")
    raise invalid("'prompt' must be a string", "prompt")


def _completion_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t: v for t, _, v in e.top} for e in entries],
        "text_offset": [],
    }


async def completions(request: Request) -> Response:
    body = await read_json(request)
    model = f.string(body, "model") or ""  # none: the --fallback-model's, else a 400 (plan.py)
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
        n=_num_choices(body),
        cache_salt=cache_salt(request, body),
    )
    echo = prompt if f.boolean(body, "echo", False) else ""
    plan = make_plan(chat, state_of(request).registry)
    head = {
        "id": new_id("cmpl-"),
        "object": "text_completion",
        "created": int(time.time()),
        "model": chat.model,
    }

    def choice(index: int, text: str, logprobs: Any, finish: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    if not stream:
        choices = await collect(request, plan)
        rendered = [
            choice(
                i,
                echo + c.joined("text", "reasoning"),  # a raw prompt's reply is all text
                _completion_logprobs(c.logprobs) if sampling.logprobs else None,
                finish_reason(c.finish),
            )
            for i, c in enumerate(choices)
        ]
        return _reply(head, rendered, [c.finish for c in choices])

    usage_null = {"usage": None} if include_usage else {}

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> bytes:
        return sse_data({**head, "choices": [choice(index, text, logprobs, finish)], **usage_null})

    async def render(index: int, events: AsyncIterator[Any], finishes: list[Finish]) -> AsyncIterator[bytes]:
        if echo:
            yield chunk(index, echo)
        async for event in events:
            if isinstance(event, TextDelta | ReasoningDelta):
                lps = event.logprobs if isinstance(event, TextDelta) else None
                yield chunk(index, event.text, _completion_logprobs(lps) if lps else None)
            elif isinstance(event, Finish):
                finishes.append(event)
                yield chunk(index, "", finish=finish_reason(event))
            elif isinstance(event, Ping):
                yield SSE_PING

    return await _sse_choices(request, plan, state_of(request).ping_interval, head, include_usage, render)


def routes() -> list[Route]:
    wrap = endpoint(openai_error)
    return [
        Route("/v1/chat/completions", wrap(chat_completions), methods=["POST"]),
        Route("/v1/completions", wrap(completions), methods=["POST"]),
    ]
