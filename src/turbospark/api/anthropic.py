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
- `thinking` disabled -> effort off; enabled -> an effort from `budget_tokens` (or from
  `output_config.effort`) with that budget enforced; adaptive -> `output_config.effort`, else the
  backend's default, else medium; not sent -> the backend's default. `output_config.effort`
  max -> high. `output_config.format` (or the older `output_format`) is a JSON-schema output.
- Thinking blocks carry a signature: an HMAC of the thinking text under a per-process key,
  stable within one server process and opaque to the client.
- Errors use Anthropic's envelope; a full admission queue is 529 overloaded_error with
  Retry-After. Requests that carry `anthropic-version` also get this envelope on /v1/models.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from turbospark.api import fields as f
from turbospark.api import openai
from turbospark.api.common import (
    Handler,
    endpoint,
    new_id,
    prime,
    read_json,
    retry_headers,
    sse_response,
    state_of,
    until_disconnect,
)
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
from turbospark.generate import run_choice, stream_choice
from turbospark.plan import Plan, make_plan
from turbospark.registry import ModelRegistry
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

# ---------------------------------------------------------------- errors

_ERROR_TYPES = {
    ErrorKind.INVALID_REQUEST: "invalid_request_error",
    ErrorKind.AUTHENTICATION: "authentication_error",
    ErrorKind.PERMISSION: "permission_error",
    ErrorKind.NOT_FOUND: "not_found_error",
    ErrorKind.TOO_LARGE: "request_too_large",
    ErrorKind.OVERLOADED: "overloaded_error",
    ErrorKind.UNAVAILABLE: "api_error",
    ErrorKind.INTERNAL: "api_error",
}
OVERLOADED_STATUS = 529


def error_body(exc: ApiError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ERROR_TYPES[exc.kind], "message": exc.message}}


def error_status(exc: ApiError) -> int:
    return OVERLOADED_STATUS if exc.kind is ErrorKind.OVERLOADED else exc.status


def render_error(exc: ApiError) -> Response:
    return Response(
        orjson.dumps(error_body(exc)),
        status_code=error_status(exc),
        media_type="application/json",
        headers=retry_headers(exc),
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


@dataclass(slots=True)
class Thinking:
    """What the request asked of thinking, resolved to an effort once the backend is known."""

    mode: str | None = None  # None (not sent), "enabled", "adaptive" or "disabled"
    budget: int | None = None
    effort: ReasoningEffort | None = None  # output_config.effort

    def resolve(self, default: ReasoningEffort) -> ReasoningEffort | None:
        if self.mode == "disabled":
            return ReasoningEffort.OFF
        if self.effort is not None:
            return self.effort
        if self.mode == "enabled":
            assert self.budget is not None
            if self.budget <= 1024:
                return ReasoningEffort.LOW
            return ReasoningEffort.MEDIUM if self.budget <= 4096 else ReasoningEffort.HIGH
        if self.mode == "adaptive":
            return default if default is not ReasoningEffort.OFF else ReasoningEffort.MEDIUM
        return None  # not sent: the backend's default applies in the plan


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


@dataclass(slots=True)
class ParsedMessages:
    messages: list[Message]
    prefill: str | None = None  # a final assistant turn's text, which the reply continues


def parse_messages(raw: Any, system: str | None) -> ParsedMessages:
    if raw is None:
        raise invalid("'messages' is required", "messages")
    if not isinstance(raw, list):
        raise invalid("'messages' must be an array", "messages")
    if not raw:
        raise invalid("'messages' must contain at least one message", "messages")
    leading_system = [system] if system else []
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool results that follow
    for i, item in enumerate(raw):
        where = f"messages[{i}]"
        item = f.as_object(item, where)
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
    parsed = ParsedMessages(out)
    last = out[-1]
    if last.role == "assistant":
        if last.tool_calls:
            raise invalid(
                "the last message is an assistant turn with tool_use; send the tool_result in a user "
                "message after it",
                "messages",
            )
        parsed.prefill = last.content or None  # an empty final turn asks for nothing
        out.pop()
        if not out:
            raise invalid("'messages' must start with a user message", "messages")
    if leading_system:
        out.insert(0, Message(role="system", content="\n\n".join(leading_system)))
    return parsed


def parse_tools(raw: Any) -> list[Tool]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise invalid("'tools' must be an array", "tools")
    tools = []
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        item = f.as_object(item, where)
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


def parse_tool_choice(raw: Any, tools: list[Tool]) -> tuple[ToolChoice, bool]:
    """The choice, and whether parallel tool calls are allowed."""
    if raw is None:
        return ToolChoice(), True
    body = f.as_object(raw, "tool_choice")
    kind = f.string(body, "type", "tool_choice.type", required=True)
    parallel = not f.boolean(
        body, "disable_parallel_tool_use", False, "tool_choice.disable_parallel_tool_use"
    )
    if kind == "auto":
        return ToolChoice(ToolChoiceMode.AUTO), parallel
    if kind == "none":
        return ToolChoice(ToolChoiceMode.NONE), parallel
    if not tools:
        raise invalid(f"'tool_choice.type' is {kind!r} but the request has no tools", "tool_choice")
    if kind == "any":
        return ToolChoice(ToolChoiceMode.REQUIRED), parallel
    if kind == "tool":
        name = f.string(body, "name", "tool_choice.name", required=True)
        if name not in {t.name for t in tools}:
            raise invalid(f"'tool_choice.name' {name!r} is not one of 'tools'", "tool_choice.name")
        return ToolChoice(ToolChoiceMode.NAMED, name), parallel
    raise invalid(f"'tool_choice.type' must be auto, any, tool or none, got {kind!r}", "tool_choice.type")


def parse_thinking(body: dict[str, Any]) -> Thinking:
    spec = Thinking()
    raw = f.obj(body, "thinking")
    if raw is not None:
        spec.mode = f.string(raw, "type", "thinking.type", required=True)
        if spec.mode not in ("enabled", "disabled", "adaptive"):
            raise invalid(
                f"'thinking.type' must be enabled, adaptive or disabled, got {spec.mode!r}", "thinking.type"
            )
        if spec.mode == "enabled":
            spec.budget = f.integer(raw, "budget_tokens", "thinking.budget_tokens", minimum=1)
            if spec.budget is None:
                raise invalid("'thinking.budget_tokens' is required when thinking is enabled", "thinking")
    config = f.obj(body, "output_config") or {}
    effort = config.get("effort")
    if effort is not None:
        if effort not in _EFFORTS:
            raise invalid(
                f"'output_config.effort' must be one of {', '.join(_EFFORTS)}, got {effort!r}",
                "output_config.effort",
            )
        spec.effort = _EFFORTS[effort]
    return spec


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
    sp = SamplingParams()
    temperature = f.number(body, "temperature", minimum=0.0, maximum=1.0)
    sp.temperature = 1.0 if temperature is None else temperature
    top_p = f.number(body, "top_p", minimum=0.0, maximum=1.0)
    sp.top_p = 1.0 if top_p is None else top_p
    sp.top_k = f.integer(body, "top_k", minimum=0) or 0
    return sp


def _stop_sequences(body: dict[str, Any]) -> list[str]:
    raw = f.array(body, "stop_sequences") or []
    for i, stop in enumerate(raw):
        if not isinstance(stop, str) or not stop:
            raise invalid(f"'stop_sequences[{i}]' must be a non-empty string", f"stop_sequences[{i}]")
    return list(raw)


@dataclass(slots=True)
class MessagesRequest:
    chat: ChatRequest
    thinking: Thinking
    prefill: str | None


def parse_messages_request(body: dict[str, Any], *, count_only: bool = False) -> MessagesRequest:
    """A /v1/messages body (or a count_tokens body, which has no max_tokens) as a ChatRequest."""
    model = f.string(body, "model", required=True) or ""
    max_tokens = None
    if not count_only:
        max_tokens = f.integer(body, "max_tokens", minimum=1)
        if max_tokens is None:
            raise invalid("'max_tokens' is required", "max_tokens")
    raw_system = body.get("system")
    system = None if raw_system is None else _text_of_blocks(raw_system, "system", drop_attribution=True)
    parsed = parse_messages(body.get("messages"), system)
    tools = parse_tools(body.get("tools"))
    choice, parallel = parse_tool_choice(body.get("tool_choice"), tools)
    chat = ChatRequest(
        model=model,
        messages=parsed.messages,
        tools=[] if choice.mode is ToolChoiceMode.NONE else tools,
        tool_choice=choice,
        parallel_tool_calls=parallel,
        response_format=parse_output_format(body),
        sampling=parse_sampling(body),
        max_tokens=max_tokens,
        stop=[] if count_only else _stop_sequences(body),
        stream=False if count_only else f.boolean(body, "stream", False),
    )
    f.obj(body, "metadata")  # accepted, unused; still must be an object
    thinking = parse_thinking(body)
    if parsed.prefill is not None and thinking.mode in ("enabled", "adaptive"):
        raise invalid(
            "a final assistant message (prefill) cannot be combined with thinking; disable thinking or "
            "end with a user message",
            "messages",
        )
    return MessagesRequest(chat, thinking, parsed.prefill)


def plan_messages(parsed: MessagesRequest, registry: ModelRegistry) -> Plan:
    chat = parsed.chat
    backend = registry.resolve(chat.model)
    chat.reasoning_effort = parsed.thinking.resolve(backend.default_reasoning())
    chat.thinking_budget = parsed.thinking.budget
    if parsed.prefill is not None:
        chat.reasoning_effort = ReasoningEffort.OFF  # a prefill must not land inside a think block
    plan = make_plan(chat, registry)
    if parsed.prefill is not None:
        _apply_prefill(plan, parsed.prefill)
    return plan


def _apply_prefill(plan: Plan, prefill: str) -> None:
    """Appends the assistant's prefill after the generation prompt; the reply continues it."""
    backend = plan.backend
    plan.prompt_text += prefill
    plan.prompt_ids = backend.tokenizer.encode(plan.prompt_text, add_special_tokens=False)
    plan.start_in_reasoning = False
    room = backend.max_context - len(plan.prompt_ids)
    if room < 1:
        raise invalid(
            f"the prompt is {len(plan.prompt_ids)} tokens, which does not fit model {backend.model_id!r}'s "
            f"context of {backend.max_context} tokens",
            "messages",
        )
    plan.config.max_new_tokens = min(plan.config.max_new_tokens, room)


# ---------------------------------------------------------------- rendering

_SIGNING_KEY = secrets.token_bytes(32)


def thinking_signature(thinking: str) -> str:
    digest = hmac.new(_SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()
    return base64.b64encode(digest).decode()


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


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
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ApiError(
            ErrorKind.INTERNAL, f"the model's tool call arguments are not a JSON object: {arguments!r}"
        )
    return value


def content_blocks(events: list[Event]) -> list[dict[str, Any]]:
    """One choice's events as the content blocks of a non-streaming message."""
    blocks: list[dict[str, Any]] = []
    arguments: dict[int, list[str]] = {}  # tool call index -> its argument fragments
    calls: dict[int, dict[str, Any]] = {}  # tool call index -> its block
    for event in events:
        kind = blocks[-1]["type"] if blocks else None
        if isinstance(event, ReasoningDelta):
            if kind != "thinking":
                blocks.append({"type": "thinking", "thinking": "", "signature": ""})
            blocks[-1]["thinking"] += event.text
        elif isinstance(event, TextDelta) and event.text:
            if kind != "text":
                blocks.append({"type": "text", "text": ""})
            blocks[-1]["text"] += event.text
        elif isinstance(event, ToolCallStart):
            calls[event.index] = {"type": "tool_use", "id": tool_use_id(event.id), "name": event.name}
            arguments[event.index] = []
            blocks.append(calls[event.index])
        elif isinstance(event, ToolCallArgs):
            arguments[event.index].append(event.delta)
    for block in blocks:
        if block["type"] == "thinking":
            block["signature"] = thinking_signature(block["thinking"])
    for index, block in calls.items():
        block["input"] = _tool_input("".join(arguments[index]))
    return blocks


def message_object(ident: str, model: str, events: list[Event]) -> dict[str, Any]:
    finish = events[-1]
    assert isinstance(finish, Finish)
    return {
        "id": ident,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(events),
        "stop_reason": stop_reason(finish),
        "stop_sequence": finish.stop_sequence,
        "usage": usage_dict(finish.usage),
    }


def sse_event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


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
    parsed = parse_messages_request(body)
    state = state_of(request)
    plan = plan_messages(parsed, state.registry)
    chat = plan.request
    ident = new_id("msg_")
    if chat.stream:
        return await _stream_message(request, plan, ident, state.ping_interval)
    events = await until_disconnect(request, run_choice(plan))
    return Response(orjson.dumps(message_object(ident, chat.model, events)), media_type="application/json")


async def _stream_message(request: Request, plan: Plan, ident: str, ping_interval: float) -> Response:
    chat = plan.request
    # An error before the first event (a full queue, a prompt the backend refuses) is still a
    # plain HTTP error; anything after the stream started is an `event: error` frame. The first
    # event comes within one ping interval even while the request waits in line.
    stream = cast(AsyncGenerator[Event, None], stream_choice(plan, 0, ping_interval))
    first, events = await prime(request, stream)

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
            if first is not None:
                for frame in writer.feed(first):
                    yield frame
            async for event in events:
                for frame in writer.feed(event):
                    yield frame
        except ApiError as exc:
            yield sse_event("error", error_body(exc))
        finally:
            with contextlib.suppress(BaseException):  # torn down on disconnect: stop generating
                await events.aclose()

    return sse_response(frames())


async def count_tokens(request: Request) -> Response:
    body = await read_json(request)
    parsed = parse_messages_request(body, count_only=True)
    plan = plan_messages(parsed, state_of(request).registry)
    return Response(orjson.dumps({"input_tokens": len(plan.prompt_ids)}), media_type="application/json")


def _by_dialect(handler: Handler) -> Handler:
    """A shared route that answers errors in Anthropic's envelope to callers that speak it."""
    as_anthropic = endpoint(render_error)(handler)
    as_openai = endpoint(openai.render_error)(handler)

    async def run(request: Request) -> Response:
        if "anthropic-version" in request.headers:
            return await as_anthropic(request)
        return await as_openai(request)

    run.__name__ = handler.__name__
    return run


def routes() -> list[Route]:
    """Mount before the OpenAI routes: /v1/models is shared, with the envelope chosen per caller."""
    wrap = endpoint(render_error)
    return [
        Route("/v1/messages", wrap(messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", wrap(count_tokens), methods=["POST"]),
        Route("/v1/models", _by_dialect(openai.list_models), methods=["GET"]),
        Route("/v1/models/{model_id:path}", _by_dialect(openai.get_model), methods=["GET"]),
    ]
