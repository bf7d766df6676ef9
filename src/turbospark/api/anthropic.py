"""Anthropic Messages wire format: /v1/messages and /v1/messages/count_tokens.

Parses Messages bodies into `ChatRequest` and renders events back as an Anthropic `message`
object or its SSE stream (message_start, ping, content_block_start / delta / stop, message_delta,
message_stop; `event: error` once the stream has started). Bodies are accepted as real clients
send them: Claude Code, the anthropic SDK's `model_dump()` history (null extras), beta fields.

Mapping decisions, stated once:
- `system` (a string or text blocks) and system-role messages before the first turn become one
  system message; a system-role message later in `messages` stays a system turn in place.
- Claude Code's first system block is an attribution line (`x-anthropic-billing-header: ...`)
  that changes between requests. It means nothing to a local model and would make prompts
  differ from their first tokens on, defeating prompt-prefix reuse, so a system block that
  starts with it is dropped.
- `tool_result` blocks become tool messages (named after the matching `tool_use`); an error
  result is prefixed with "Error: ". Thinking blocks in history become the turn's reasoning;
  `redacted_thinking` is skipped. A final assistant message is a prefill the reply continues.
- `thinking` disabled -> effort off; enabled -> `budget_tokens` (enforced) and
  `output_config.effort` if sent; adaptive -> thinking on at `output_config.effort`; the plan
  turns these into one effort (`turbospark.plan.reasoning_effort`). `output_config.effort`
  max -> high. `output_config.format` (or the older `output_format`) is a JSON-schema output.
- Thinking blocks carry a signature: an HMAC of the thinking text under a per-process key,
  stable within one server process and opaque to the client.
- Tool-use ids are the engine's call ids with Anthropic's `toolu_` prefix.
- Errors use Anthropic's envelope (`api/envelopes.py`); a full admission queue is 529
  overloaded_error with Retry-After.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import secrets
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from turbospark.api import fields as f
from turbospark.api.common import cache_salt, endpoint, new_id, read_json, sse_response, state_of
from turbospark.api.envelopes import anthropic_error, anthropic_error_body
from turbospark.api.kit import CollectedChoice, collect, sse_event, start_stream, tool_arguments
from turbospark.api.parsing import parse_temperature_top_p
from turbospark.backend import ReasoningEffort, RequestImage
from turbospark.errors import ApiError, ErrorKind, invalid
from turbospark.events import (
    Event,
    Finish,
    Ping,
    ReasoningDelta,
    TextDelta,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)
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

# ---------------------------------------------------------------- parsing

# Claude Code puts this per-request line first in `system`; see the module docstring.
ATTRIBUTION_PREFIX = "x-anthropic-billing-header:"

_EFFORTS = {
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
    "xhigh": ReasoningEffort.HIGH,
    "max": ReasoningEffort.HIGH,
}


def _text_of_blocks(raw: Any, where: str, *, drop_attribution: bool = False) -> str:
    """A string, or an array of text blocks joined by newlines."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise invalid(f"'{where}' must be a string or an array of text blocks", where)
    texts = []
    for i, block in enumerate(raw):
        bw = f"{where}[{i}]"
        block = f.as_object(block, bw)
        kind = f.string(block, "type", f"{bw}.type", required=True)
        if kind != "text":
            raise invalid(f"'{bw}.type' must be 'text', got {kind!r}", f"{bw}.type")
        text = f.string(block, "text", f"{bw}.text", required=True) or ""
        if drop_attribution and text.startswith(ATTRIBUTION_PREFIX):
            continue
        texts.append(text)
    return "\n".join(texts)


def _image(block: dict[str, Any], where: str) -> RequestImage:
    source = f.obj(block, "source", f"{where}.source", required=True) or {}
    kind = f.string(source, "type", f"{where}.source.type", required=True)
    if kind == "base64":
        data = f.string(source, "data", f"{where}.source.data", required=True) or ""
        media_type = f.string(source, "media_type", f"{where}.source.media_type")
        return f.decode_base64_image(data, f"{where}.source.data", media_type)
    if kind == "url":
        raise invalid(
            f"'{where}.source' is a URL; this server does not fetch images: send the image as base64",
            f"{where}.source",
        )
    raise invalid(f"'{where}.source.type' must be 'base64', got {kind!r}", f"{where}.source.type")


def _document_text(block: dict[str, Any], where: str) -> str:
    source = f.obj(block, "source", f"{where}.source", required=True) or {}
    kind = f.string(source, "type", f"{where}.source.type", required=True)
    if kind == "text":
        return f.string(source, "data", f"{where}.source.data", required=True) or ""
    if kind == "content":
        return _text_of_blocks(source.get("content"), f"{where}.source.content")
    raise invalid(
        f"'{where}.source.type' {kind!r} is not supported; send documents as plain text",
        f"{where}.source.type",
    )


def _add_content(block: dict[str, Any], kind: str | None, where: str, msg: Message, texts: list[str]) -> bool:
    """Adds a text, image or document block to `msg` (text to `texts`); False for other kinds."""
    if kind == "text":
        texts.append(f.string(block, "text", f"{where}.text", required=True) or "")
    elif kind == "image":
        msg.images.append(_image(block, where))
    elif kind == "document":
        texts.append(_document_text(block, where))
    else:
        return False
    return True


def _tool_result(block: dict[str, Any], where: str, names: dict[str, str]) -> Message:
    tool_use_id = f.string(block, "tool_use_id", f"{where}.tool_use_id", required=True) or ""
    msg = Message(role="tool", tool_call_id=tool_use_id, name=names.get(tool_use_id))
    content = block.get("content")
    texts: list[str] = []
    if isinstance(content, str):
        texts.append(content)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            pw = f"{where}.content[{j}]"
            part = f.as_object(part, pw)
            kind = f.string(part, "type", f"{pw}.type", required=True)
            if not _add_content(part, kind, pw, msg, texts):
                raise invalid(
                    f"'{pw}.type' {kind!r} is not supported in a tool result; use 'text' or 'image'",
                    f"{pw}.type",
                )
    elif content is not None:
        raise invalid(f"'{where}.content' must be a string or an array of blocks", f"{where}.content")
    msg.content = "\n".join(texts)
    if f.boolean(block, "is_error", False, f"{where}.is_error"):
        msg.content = "Error: " + msg.content
    return msg


def _user_message(content: Any, where: str, names: dict[str, str]) -> list[Message]:
    """One Anthropic user turn: tool results become tool messages, the rest a user message."""
    if isinstance(content, str):
        return [Message(role="user", content=content)]
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or an array of content blocks", where)
    if not content:
        raise invalid(f"'{where}' must contain at least one content block", where)
    out: list[Message] = []
    current: Message | None = None
    texts: list[str] = []

    def close_user() -> None:
        nonlocal current
        if current is not None:
            current.content = "\n".join(texts)
            out.append(current)
            current = None
            texts.clear()

    for i, block in enumerate(content):
        bw = f"{where}[{i}]"
        block = f.as_object(block, bw)
        kind = f.string(block, "type", f"{bw}.type", required=True)
        if kind == "tool_result":
            close_user()
            out.append(_tool_result(block, bw, names))
            continue
        if current is None:
            current = Message(role="user")
        if _add_content(block, kind, bw, current, texts):
            continue
        if kind in ("tool_use", "thinking", "redacted_thinking"):
            raise invalid(f"'{bw}.type' {kind!r} is only allowed in assistant messages", f"{bw}.type")
        raise invalid(
            f"'{bw}.type' {kind!r} is not supported; use text, image, document or tool_result", f"{bw}.type"
        )
    close_user()
    return out


def _assistant_message(content: Any, where: str, names: dict[str, str]) -> Message:
    msg = Message(role="assistant")
    if isinstance(content, str):
        msg.content = content
        return msg
    if not isinstance(content, list):
        raise invalid(f"'{where}' must be a string or an array of content blocks", where)
    texts: list[str] = []
    thoughts: list[str] = []
    for i, block in enumerate(content):
        bw = f"{where}[{i}]"
        block = f.as_object(block, bw)
        kind = f.string(block, "type", f"{bw}.type", required=True)
        if kind == "text":
            texts.append(f.string(block, "text", f"{bw}.text", required=True) or "")
        elif kind == "thinking":
            thoughts.append(f.string(block, "thinking", f"{bw}.thinking", required=True) or "")
        elif kind == "redacted_thinking":
            continue  # opaque to us: there is nothing a local model could read in it
        elif kind == "tool_use":
            call_id = f.string(block, "id", f"{bw}.id", required=True) or ""
            name = f.string(block, "name", f"{bw}.name", required=True) or ""
            arguments = f.obj(block, "input", f"{bw}.input")
            names[call_id] = name
            msg.tool_calls.append(ToolCall(call_id, name, orjson.dumps(arguments or {}).decode()))
        elif kind in ("tool_result", "image", "document"):
            raise invalid(f"'{bw}.type' {kind!r} is only allowed in user messages", f"{bw}.type")
        else:
            raise invalid(
                f"'{bw}.type' {kind!r} is not supported; use text, thinking or tool_use", f"{bw}.type"
            )
    msg.content = "".join(texts)
    msg.reasoning = "\n".join(thoughts) if thoughts else None
    return msg


def parse_messages(raw: Any, system: str | None) -> tuple[list[Message], str | None]:
    """The messages, and the prefill: a final assistant turn's text, which the reply continues."""
    leading_system = [system] if system else []
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool results that follow
    for where, item in f.required_objects(raw, "messages", "message"):
        role = f.string(item, "role", f"{where}.role", required=True)
        content = item.get("content")
        if content is None:
            raise invalid(f"'{where}.content' is required", f"{where}.content")
        if role == "user":
            out.extend(_user_message(content, f"{where}.content", names))
        elif role == "assistant":
            out.append(_assistant_message(content, f"{where}.content", names))
        elif role == "system":
            text = _text_of_blocks(content, f"{where}.content")
            if out:
                out.append(Message(role="system", content=text))
            else:
                leading_system.append(text)
        else:
            raise invalid(
                f"'{where}.role' must be 'user' or 'assistant' (or 'system'), got {role!r}", f"{where}.role"
            )
    if not out:
        raise invalid("'messages' must contain at least one user or assistant message", "messages")
    prefill = None
    last = out[-1]
    if last.role == "assistant":
        if last.tool_calls:
            raise invalid(
                "the last message is an assistant turn with tool_use; send the tool_result in a user "
                "message after it",
                "messages",
            )
        prefill = last.content or None  # an empty final turn asks for nothing
        out.pop()
        if not out:
            raise invalid("'messages' must start with a user message", "messages")
    if leading_system:
        out.insert(0, Message(role="system", content="\n\n".join(leading_system)))
    return out, prefill


def parse_tools(raw: Any) -> list[Tool]:
    tools = []
    for where, item in f.objects(raw, "tools"):
        kind = f.string(item, "type", f"{where}.type")
        name = f.string(item, "name", f"{where}.name", required=True) or ""
        if kind not in (None, "custom"):
            raise invalid(
                f"'{where}.type' {kind!r} is a server tool this server does not run; declare it as a "
                "custom tool with an input_schema",
                f"{where}.type",
            )
        schema = f.obj(item, "input_schema", f"{where}.input_schema", required=True) or {}
        tools.append(
            Tool(
                name=name,
                description=f.string(item, "description", f"{where}.description") or "",
                parameters=schema,
                strict=f.boolean(item, "strict", False, f"{where}.strict"),
            )
        )
    return tools


_CHOICE_MODES = {"auto": ToolChoiceMode.AUTO, "none": ToolChoiceMode.NONE, "any": ToolChoiceMode.REQUIRED}


def parse_tool_choice(raw: Any) -> tuple[ToolChoice, bool]:
    """The choice, and whether parallel tool calls are allowed."""
    if raw is None:
        return ToolChoice(), True
    body = f.as_object(raw, "tool_choice")
    kind = f.string(body, "type", "tool_choice.type", required=True)
    parallel = not f.boolean(
        body, "disable_parallel_tool_use", False, "tool_choice.disable_parallel_tool_use"
    )
    if kind in _CHOICE_MODES:
        return ToolChoice(_CHOICE_MODES[kind], where="tool_choice.type", as_written=kind), parallel
    if kind == "tool":
        name = f.string(body, "name", "tool_choice.name", required=True) or ""
        return ToolChoice(ToolChoiceMode.NAMED, name, where="tool_choice.name", as_written=name), parallel
    raise invalid(f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


def parse_thinking(body: dict[str, Any], chat: ChatRequest) -> None:
    """`thinking` and `output_config.effort` onto the request (the plan resolves the effort)."""
    config = f.obj(body, "output_config") or {}
    effort = config.get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise invalid(
                f"'output_config.effort' must be one of {', '.join(_EFFORTS)}, got {effort!r}",
                "output_config.effort",
            )
        chat.reasoning_effort = _EFFORTS[effort]
    raw = f.obj(body, "thinking")
    if raw is None:
        return
    mode = f.string(raw, "type", "thinking.type", required=True)
    if mode not in ("enabled", "disabled", "adaptive"):
        raise invalid(f"'thinking.type' must be enabled, adaptive or disabled, got {mode!r}", "thinking.type")
    if mode == "disabled":
        chat.reasoning_effort = ReasoningEffort.OFF
        return
    chat.thinking_on = True
    if mode == "enabled":
        chat.thinking_budget = f.integer(raw, "budget_tokens", "thinking.budget_tokens", minimum=1)
        if chat.thinking_budget is None:
            raise invalid("'thinking.budget_tokens' is required when thinking is enabled", "thinking")


def parse_output_format(body: dict[str, Any]) -> ResponseFormat | None:
    """Structured outputs: `output_config.format`, or the older top-level `output_format`."""
    config = f.obj(body, "output_config") or {}
    where = "output_config.format"
    raw = config.get("format")
    if raw is None:
        where, raw = "output_format", body.get("output_format")
    if raw is None:
        return None
    spec = f.as_object(raw, where)
    kind = f.string(spec, "type", f"{where}.type", required=True)
    if kind != "json_schema":
        raise invalid(f"'{where}.type' must be 'json_schema', got {kind!r}", f"{where}.type")
    schema = f.obj(spec, "schema", f"{where}.schema", required=True)
    return ResponseFormat("json_schema", schema=schema, strict=True)


def parse_sampling(body: dict[str, Any]) -> SamplingParams:
    sp = parse_temperature_top_p(body, max_temperature=1.0)
    sp.top_k = f.integer(body, "top_k", minimum=0)
    return sp


def _stop_sequences(body: dict[str, Any]) -> list[str]:
    raw = f.array(body, "stop_sequences") or []
    for i, stop in enumerate(raw):
        if not isinstance(stop, str) or not stop:
            raise invalid(f"'stop_sequences[{i}]' must be a non-empty string", f"stop_sequences[{i}]")
    return list(raw)


def parse_messages_request(body: dict[str, Any], *, count_only: bool = False) -> ChatRequest:
    """A /v1/messages body (or a count_tokens body, which has no max_tokens) as a ChatRequest."""
    model = f.string(body, "model") or ""  # none: the --fallback-model's, else a 400 (plan.py)
    max_tokens = None
    if not count_only:
        max_tokens = f.integer(body, "max_tokens", minimum=1)
        if max_tokens is None:
            raise invalid("'max_tokens' is required", "max_tokens")
    raw_system = body.get("system")
    system = None if raw_system is None else _text_of_blocks(raw_system, "system", drop_attribution=True)
    messages, prefill = parse_messages(body.get("messages"), system)
    choice, parallel = parse_tool_choice(body.get("tool_choice"))
    chat = ChatRequest(
        model=model,
        messages=messages,
        tools=parse_tools(body.get("tools")),
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=parse_output_format(body),
        sampling=parse_sampling(body),
        max_tokens=max_tokens,
        stop=[] if count_only else _stop_sequences(body),
        stream=False if count_only else f.boolean(body, "stream", False),
        prefill=prefill,
    )
    f.obj(body, "metadata")  # accepted, unused; still must be an object
    parse_thinking(body, chat)
    return chat


# ---------------------------------------------------------------- rendering

_SIGNING_KEY = secrets.token_bytes(32)


def thinking_signature(thinking: str) -> str:
    digest = hmac.new(_SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id


def stop_reason(finish: Finish) -> str:
    if finish.stop_sequence is not None:
        return "stop_sequence"
    if finish.reason == "tool_calls":
        return "tool_use"
    if finish.reason == "length":
        return "max_tokens"
    return "end_turn"


def usage_dict(usage: Usage) -> dict[str, Any]:
    # Anthropic counts prompt tokens read from the cache apart from the rest of the input.
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def _tool_input(arguments: str) -> dict[str, Any]:
    value = tool_arguments(arguments)
    if value is None:
        raise ApiError(
            ErrorKind.INTERNAL, f"the model's tool call arguments are not a JSON object: {arguments!r}"
        )
    return value


def content_blocks(choice: CollectedChoice) -> list[dict[str, Any]]:
    """One choice as the content blocks of a non-streaming message."""
    blocks: list[dict[str, Any]] = []
    for segment in choice.segments:
        if segment.kind == "reasoning":
            signature = thinking_signature(segment.text)
            blocks.append({"type": "thinking", "thinking": segment.text, "signature": signature})
        elif segment.kind == "text":
            blocks.append({"type": "text", "text": segment.text})
        else:
            assert segment.call is not None
            call = segment.call
            blocks.append(
                {
                    "type": "tool_use",
                    "id": tool_use_id(call.id),
                    "name": call.name,
                    "input": _tool_input(call.arguments),
                }
            )
    return blocks


def message_object(ident: str, model: str, choice: CollectedChoice) -> dict[str, Any]:
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(choice),
        "stop_reason": stop_reason(choice.finish),
        "stop_sequence": choice.finish.stop_sequence,
        "usage": usage_dict(choice.finish.usage),
    }


PING = sse_event("ping", {"type": "ping"})


class StreamWriter:
    """Events in, Anthropic SSE frames out: opens and closes one content block at a time."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's type
        self.thinking: list[str] = []

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = block["type"]
        out.append(
            sse_event(
                "content_block_start",
                {"type": "content_block_start", "index": self.index, "content_block": block},
            )
        )
        return out

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    def close(self) -> list[bytes]:
        """Closes the open block, if any (a thinking block gets its signature first)."""
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            signature = thinking_signature("".join(self.thinking))
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
            self.thinking = []
        out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.kind = None
        return out

    def feed(self, event: Event) -> list[bytes]:
        out: list[bytes] = []
        if isinstance(event, ReasoningDelta):
            if self.kind != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            self.thinking.append(event.text)
            out.append(self._delta({"type": "thinking_delta", "thinking": event.text}))
        elif isinstance(event, TextDelta):
            if event.text:
                if self.kind != "text":
                    out += self._open({"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": event.text}))
        elif isinstance(event, ToolCallStart):
            out += self._open(
                {"type": "tool_use", "id": tool_use_id(event.id), "name": event.name, "input": {}}
            )
        elif isinstance(event, ToolCallArgs):
            if event.delta:
                out.append(self._delta({"type": "input_json_delta", "partial_json": event.delta}))
        elif isinstance(event, Ping):
            out.append(PING)
        elif isinstance(event, Finish):
            out += self.close()
            delta = {"stop_reason": stop_reason(event), "stop_sequence": event.stop_sequence}
            message_delta = {"type": "message_delta", "delta": delta, "usage": usage_dict(event.usage)}
            out.append(sse_event("message_delta", message_delta))
            out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out


async def messages(request: Request) -> Response:
    body = await read_json(request)
    chat = parse_messages_request(body)
    chat.cache_salt = cache_salt(request, body)
    state = state_of(request)
    plan = make_plan(chat, state.registry)
    ident = new_id("msg_")
    if chat.stream:
        return await _stream_message(request, plan, ident, state.ping_interval)
    (choice,) = await collect(request, plan)
    return Response(orjson.dumps(message_object(ident, chat.model, choice)), media_type="application/json")


async def _stream_message(request: Request, plan: Plan, ident: str, ping_interval: float) -> Response:
    chat = plan.request
    # An error before the first event (a full queue, a prompt the backend refuses) is still a
    # plain HTTP error; anything after the stream started is an `event: error` frame. The first
    # event comes within one ping interval even while the request waits in line.
    events = await start_stream(request, plan, ping_interval)

    start = {
        "type": "message_start",
        "message": {
            "id": ident,
            "type": "message",
            "role": "assistant",
            "model": chat.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(plan.prompt_ids),
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
                "output_tokens": 0,
            },
        },
    }

    async def frames() -> AsyncIterator[bytes]:
        writer = StreamWriter()
        yield sse_event("message_start", start)
        yield PING
        try:
            async for event in events:
                for frame in writer.feed(event):
                    yield frame
        except ApiError as exc:
            yield sse_event("error", anthropic_error_body(exc))
        finally:
            with contextlib.suppress(BaseException):  # torn down on disconnect: stop generating
                await events.aclose()

    return sse_response(frames())


async def count_tokens(request: Request) -> Response:
    body = await read_json(request)
    plan = make_plan(parse_messages_request(body, count_only=True), state_of(request).registry)
    return Response(orjson.dumps({"input_tokens": len(plan.prompt_ids)}), media_type="application/json")


def routes() -> list[Route]:
    wrap = endpoint(anthropic_error)
    return [
        Route("/v1/messages", wrap(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", wrap(count_tokens), methods=["POST"]),
    ]
