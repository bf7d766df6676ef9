"""OpenAI Responses API: POST /v1/responses, stateless.

`input` (a string, or items: messages, function_call, function_call_output, reasoning) plus
`instructions` parse into one `ChatRequest`; the caller sends the whole conversation each time.
Nothing is stored: `store: true` is accepted and has no effect, while `previous_response_id`,
`conversation` and `background` (which need stored responses) are a 400 that says so.

One `ResponseBuilder` turns generation events into output items (reasoning, message with
output_text, function_call) and, when streaming, into the `response.*` SSE event sequence:
created, in_progress, then per item output_item.added -> content/argument deltas ->
output_item.done, and last completed (or incomplete when max_output_tokens ran out, or an
`error` event followed by failed). A non-streaming reply is the same builder's final response,
so both forms always carry the same output.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from turbospark.api import fields as f
from turbospark.api.common import (
    cache_salt,
    endpoint,
    new_id,
    read_json,
    sse_response,
    state_of,
    until_disconnect,
)
from turbospark.api.envelopes import openai_error
from turbospark.api.kit import SSE_PING, logprob_entries, sse_event, start_stream
from turbospark.api.parsing import (
    parse_effort,
    parse_json_format,
    parse_temperature_top_p,
    parse_tool_choice,
    read_content,
)
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
from turbospark.generate import run_choice
from turbospark.plan import Plan, make_plan
from turbospark.request import (
    ChatRequest,
    Message,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolChoiceMode,
    empty_object_schema,
)

log = logging.getLogger("turbospark.api.responses")

CALL_PREFIX = "call_"  # on the engine's call ids, as OpenAI writes them

# ---------------------------------------------------------------- tools


@dataclass(frozen=True, slots=True)
class ToolOrigin:
    """How a tool the model sees under one flat name was declared, so its calls go back in the
    caller's own shape: a function inside a `namespace` tool (`namespace` + `name`), or a
    `custom` (freeform) tool whose call carries its text as `input`."""

    name: str
    namespace: str | None = None
    custom: bool = False


ToolOrigins = dict[str, ToolOrigin]


def flat_tool_name(namespace: str, name: str) -> str:
    """A namespaced function's name as the model sees it: `namespace__name`, the flat form Codex
    itself uses where a boundary cannot keep the split."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def _function_tool(item: dict[str, Any], where: str, name: str) -> Tool:
    return Tool(
        name=name,
        description=f.string(item, "description", f"{where}.description") or "",
        parameters=f.obj(item, "parameters", f"{where}.parameters") or empty_object_schema(),
        strict=f.boolean(item, "strict", False, f"{where}.strict"),
    )


def _custom_tool(item: dict[str, Any], where: str, name: str) -> Tool:
    """A freeform tool as a function of one string, `input`; its grammar (if any) goes into the
    description, since the model writes the text through an ordinary function call."""
    description = f.string(item, "description", f"{where}.description") or ""
    fmt = f.obj(item, "format", f"{where}.format") or {}
    how = "Put the tool's whole input, as free-form text, in the `input` string."
    if fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        how += f" The text must follow this {fmt.get('syntax') or 'grammar'} grammar:\n{fmt['definition']}"
    return Tool(
        name=name,
        description=f"{description}\n\n{how}".strip(),
        parameters={"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]},
    )


def parse_tools(raw: Any) -> tuple[list[Tool], ToolOrigins]:
    """The Responses `tools` array -> the function tools the model may call, and where each came
    from. `function` tools as they are; the functions of a `namespace` tool flattened to
    `namespace__name`; a `custom` tool as a function of one string. Every other kind is a tool
    only OpenAI's servers run (web_search, file_search, local_shell, mcp, ...): left out, named
    in a debug line, never refused, so an agent that always declares them still works."""
    tools: list[Tool] = []
    origins: ToolOrigins = {}
    skipped: list[str] = []

    def add(item: dict[str, Any], where: str, namespace: str | None) -> None:
        # a top-level tool names its kind; a namespace's own tools are functions unless they say
        kind = f.string(item, "type", f"{where}.type", required=namespace is None) or "function"
        if kind == "namespace" and namespace is None:
            ns = f.string(item, "name", f"{where}.name", required=True) or ""
            for sub_where, sub in f.objects(item.get("tools"), f"{where}.tools"):
                add(sub, sub_where, ns)
            return
        if kind not in ("function", "custom"):
            skipped.append(kind if namespace is None else f"{namespace}.{kind}")
            return
        name = f.string(item, "name", f"{where}.name", required=True) or ""
        flat = name if namespace is None else flat_tool_name(namespace, name)
        if flat in origins:
            raise invalid(f"'{where}.name' {flat!r} is declared twice", f"{where}.name")
        origins[flat] = ToolOrigin(name=name, namespace=namespace, custom=kind == "custom")
        tools.append((_custom_tool if kind == "custom" else _function_tool)(item, where, flat))

    for where, item in f.objects(raw, "tools"):
        add(item, where, None)
    if skipped:
        log.debug("tools this server cannot run, left out of the prompt: %s", ", ".join(skipped))
    return tools, origins


# ---------------------------------------------------------------- parsing


def _text_of(raw: Any, where: str) -> str:
    holder = Message(role="tool")
    read_content(raw, where, holder)
    if holder.images:
        raise invalid(f"'{where}' carries an image; tool outputs must be text here", where)
    return holder.content


_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# Items that record what a hosted tool did: kept in an agent's history, skipped here.
_HOSTED_CALL_ITEMS = frozenset(
    {
        "web_search_call",
        "file_search_call",
        "image_generation_call",
        "code_interpreter_call",
        "computer_call",
        "computer_call_output",
        "local_shell_call",
        "local_shell_call_output",
        "mcp_call",
        "mcp_list_tools",
        "mcp_approval_request",
        "mcp_approval_response",
        "tool_search_call",
        "tool_search_output",
    }
)


def parse_input(raw: Any, instructions: str | None) -> list[Message]:
    """`instructions` + `input` -> messages. Consecutive assistant items (reasoning, message,
    function calls) form one assistant turn, the way the model produced them."""
    messages: list[Message] = []
    if instructions:
        messages.append(Message(role="system", content=instructions))
    if isinstance(raw, str):
        messages.append(Message(role="user", content=raw))
        return messages
    if not isinstance(raw, list):
        raise invalid("'input' must be a string or an array of input items", "input")
    calls: dict[str, ToolCall] = {}
    turn: Message | None = None  # the assistant turn being assembled
    reasoning: str | None = None  # a reasoning item waiting for its turn

    def assistant_turn(new: bool) -> Message:
        nonlocal turn, reasoning
        if turn is None or new or reasoning is not None:
            turn = Message(role="assistant", reasoning=reasoning)
            reasoning = None
            messages.append(turn)
        return turn

    for i, item in enumerate(raw):
        where = f"input[{i}]"
        item = f.as_object(item, where)
        kind = f.string(item, "type", f"{where}.type") or "message"
        if kind == "message":
            role = f.string(item, "role", f"{where}.role", required=True)
            if role not in _MESSAGE_ROLES:
                raise invalid(
                    f"'{where}.role' must be one of {', '.join(_MESSAGE_ROLES)}, got {role!r}",
                    f"{where}.role",
                )
            if role == "assistant":
                # Text after this turn's tool calls starts a new turn.
                msg = assistant_turn(new=turn is not None and (bool(turn.tool_calls) or bool(turn.content)))
            else:
                msg = Message(role=role)  # type: ignore[arg-type]
                messages.append(msg)
                turn, reasoning = None, None
            read_content(f.req(item, "content", f"{where}.content"), f"{where}.content", msg)
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _text_of(parts, f"{where}.content") or None
            turn = None
        elif kind in ("function_call", "custom_tool_call"):
            call_id = f.string(item, "call_id", f"{where}.call_id", required=True) or ""
            name = f.string(item, "name", f"{where}.name", required=True) or ""
            namespace = f.string(item, "namespace", f"{where}.namespace")
            if namespace:
                name = flat_tool_name(namespace, name)
            if kind == "custom_tool_call":
                text = f.string(item, "input", f"{where}.input") or ""
                arguments = orjson.dumps({"input": text}).decode()
            else:
                arguments = f.string(item, "arguments", f"{where}.arguments") or "{}"
            call = ToolCall(id=call_id, name=name, arguments=arguments)
            assistant_turn(new=False).tool_calls.append(call)
            calls[call_id] = call
        elif kind in ("function_call_output", "custom_tool_call_output"):
            answers = f.string(item, "call_id", f"{where}.call_id")
            named = f.string(item, "name", f"{where}.name")
            found = calls.get(answers) if answers else None
            if found is None and answers:
                raise invalid(
                    f"'{where}.call_id' {answers!r} matches no function_call in 'input'; this server stores "
                    "nothing, so send the function_call item along with its output",
                    f"{where}.call_id",
                )
            if found is None and not named:
                raise invalid(f"'{where}' needs a 'call_id'", f"{where}.call_id")
            output = _text_of(f.req(item, "output", f"{where}.output"), f"{where}.output")
            reasoning = None
            messages.append(
                Message(
                    role="tool",
                    content=output,
                    tool_call_id=answers,
                    name=found.name if found is not None else named,
                )
            )
            turn = None
        elif kind in _HOSTED_CALL_ITEMS:
            # A call a hosted tool made (on another server): nothing here can render or redo it.
            log.debug("input item %s (%s) left out: this server runs no hosted tools", where, kind)
            turn = None
        elif kind == "item_reference":
            raise invalid(
                f"'{where}' is an item_reference; this server stores nothing, so send the item itself",
                f"{where}.type",
            )
        else:
            raise invalid(
                f"'{where}.type' {kind!r} is not supported; use message, function_call, "
                "function_call_output or reasoning",
                f"{where}.type",
            )
    # A reasoning item with no message or call after it belongs to no turn; it is left out.
    if not messages:
        raise invalid("'input' must contain at least one item", "input")
    return messages


def parse_text_format(raw: Any) -> ResponseFormat | None:
    text = f.as_object(raw, "text") if raw is not None else {}
    fmt = f.obj(text, "format", "text.format")
    return None if fmt is None else parse_json_format(fmt, "text.format", None)


_NEEDS_STORAGE = {
    "previous_response_id": "send the whole conversation in 'input'",
    "conversation": "send the whole conversation in 'input'",
    "prompt": "send the prompt's text in 'instructions' and 'input'",
}


def parse_request(body: dict[str, Any]) -> ChatRequest:
    return parse_body(body)[0]


def parse_body(body: dict[str, Any]) -> tuple[ChatRequest, ToolOrigins]:
    """The body -> the request, and where each of its tools came from (see `parse_tools`)."""
    for key, advice in _NEEDS_STORAGE.items():
        if body.get(key) is not None:
            raise invalid(f"'{key}' is not supported: this server stores nothing; {advice}", key)
    if f.boolean(body, "background", False):
        raise invalid(
            "'background' is not supported: this server stores nothing; stream instead", "background"
        )
    f.boolean(body, "store", False)  # accepted; nothing is stored either way
    model = f.string(body, "model") or ""  # none: the --fallback-model's, else a 400 (plan.py)
    instructions = f.string(body, "instructions")
    messages = parse_input(f.req(body, "input"), instructions)
    sampling = parse_temperature_top_p(body, max_temperature=2.0)
    top = f.integer(body, "top_logprobs", minimum=0, maximum=20)
    include = f.array(body, "include") or []
    if top is not None or "message.output_text.logprobs" in include:
        sampling.logprobs, sampling.top_logprobs = True, top or 0
    reasoning = f.obj(body, "reasoning") or {}
    tools, origins = parse_tools(body.get("tools"))
    request = ChatRequest(
        model=model,
        messages=messages,
        tools=tools,
        tool_choice=parse_tool_choice(_flat_choice(body.get("tool_choice"))),
        parallel_tool_calls=f.boolean(body, "parallel_tool_calls", True),
        response_format=parse_text_format(body.get("text")),
        sampling=sampling,
        max_tokens=f.integer(body, "max_output_tokens", minimum=1),
        stream=f.boolean(body, "stream", False),
        reasoning_effort=parse_effort(reasoning.get("effort"), "reasoning.effort"),
    )
    return request, origins


def _flat_choice(raw: Any) -> Any:
    """A `tool_choice` naming a custom tool or a namespaced function, as the function choice the
    model sees."""
    if not isinstance(raw, dict) or raw.get("type") not in ("function", "custom"):
        return raw
    name, namespace = raw.get("name"), raw.get("namespace")
    if isinstance(name, str) and isinstance(namespace, str) and namespace:
        name = flat_tool_name(namespace, name)
    return {"type": "function", "name": name}


# ---------------------------------------------------------------- rendering


def usage_dict(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def response_skeleton(plan: Plan, body: dict[str, Any]) -> dict[str, Any]:
    """The response object's request echo; output, status and usage are filled in later.
    `temperature` and `top_p` are the values sampled with (the served model's defaults for
    whichever the request left out)."""
    request = plan.request
    choice = request.tool_choice
    tool_choice: Any = (
        {"type": "function", "name": choice.name}
        if choice.mode is ToolChoiceMode.NAMED
        else choice.mode.value
    )
    fmt = request.response_format
    text_format: dict[str, Any] = {"type": "text"}
    if fmt is not None and fmt.type == "json_object":
        text_format = {"type": "json_object"}
    elif fmt is not None:
        text_format = {"type": "json_schema", "name": fmt.name or "response", "schema": fmt.schema}
        text_format["strict"] = fmt.strict
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    return {
        "id": new_id("resp_"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "max_output_tokens": request.max_tokens,
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": (reasoning or {}).get("summary")},
        "store": False,
        "temperature": plan.config.temperature,
        "text": {"format": text_format},
        "tool_choice": tool_choice,
        "tools": [
            {
                "type": "function",
                "name": t.name,
                "description": t.description or None,
                "parameters": t.parameters,
                "strict": t.strict,
            }
            for t in request.tools
        ],
        "top_p": plan.config.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


_ANSWERS = ("message", "function_call", "custom_tool_call")


class ResponseBuilder:
    """Events in, output items and `response.*` stream events out (see the module docstring).

    Whitespace between tool calls is not worth a message item: text that is only whitespace is
    held until real text follows, and dropped if a call or the end comes first while other items
    exist.
    """

    def __init__(
        self, skeleton: dict[str, Any], *, summarize: bool, origins: ToolOrigins | None = None
    ) -> None:
        self.response = skeleton
        self.origins = origins or {}  # flat tool name -> how the caller declared it
        self.summarize = summarize  # `reasoning.summary` asked for: the reasoning is its own summary
        self.num_events = 0
        self.item: dict[str, Any] | None = None  # the open output item
        self.parts: list[str] = []  # the open item's text (or arguments) so far
        self.logprobs: list[dict[str, Any]] = []
        self.held = ""  # leading whitespace of a message not opened yet

    @property
    def output(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = self.response["output"]
        return out

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.num_events, **fields}
        self.num_events += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return orjson.loads(orjson.dumps(self.response))  # type: ignore[no-any-return]

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output) - 1}

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.item = item
        self.parts, self.logprobs = [], []
        self.output.append(item)
        added = self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))
        out = [added]
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self._event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            out.append(
                self._event("response.content_part.added", **self._where(), content_index=0, part=part)
            )
        return out

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self.item
        if item is None:
            return []
        text = "".join(self.parts)
        where = self._where()
        out: list[dict[str, Any]] = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs}
            out.append(
                self._event(
                    "response.output_text.done", **where, content_index=0, text=text, logprobs=self.logprobs
                )
            )
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text}
            out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=text))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
            if self.summarize:
                summary = {"type": "summary_text", "text": text}
                empty = {"type": "summary_text", "text": ""}
                out += [
                    self._event(
                        "response.reasoning_summary_part.added", **where, summary_index=0, part=empty
                    ),
                    self._event(
                        "response.reasoning_summary_text.delta", **where, summary_index=0, delta=text
                    ),
                    self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                    self._event(
                        "response.reasoning_summary_part.done", **where, summary_index=0, part=summary
                    ),
                ]
                item["summary"] = [summary]
        elif item["type"] == "function_call":
            item["arguments"] = text
            out.append(
                self._event(
                    "response.function_call_arguments.done", **where, name=item["name"], arguments=text
                )
            )
        elif item["type"] == "custom_tool_call":
            # The model wrote {"input": "..."}; the caller gets the text. Held until the call is
            # whole: a fragment of JSON is not a fragment of the text.
            try:
                args = orjson.loads(text)
            except orjson.JSONDecodeError:
                args = None
            value = args.get("input") if isinstance(args, dict) else None
            item["input"] = value if isinstance(value, str) else text
            if item["input"]:
                out.append(self._event("response.custom_tool_call_input.delta", **where, delta=item["input"]))
            out.append(self._event("response.custom_tool_call_input.done", **where, input=item["input"]))
        item["status"] = status
        out.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self.item = None
        return out

    def _is_open(self, kind: str) -> bool:
        return self.item is not None and self.item["type"] == kind

    def _text(self, text: str, logprobs: list[dict[str, Any]], force: bool = False) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self._is_open("message"):
            if not force and not (self.held + text).strip() and not logprobs:
                self.held += text
                return out
            out += self._close()
            item = {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress"}
            out += self._open({**item, "content": []})
        text, self.held = self.held + text, ""
        if not text and not logprobs:
            return out
        self.parts.append(text)
        self.logprobs += logprobs
        out.append(
            self._event(
                "response.output_text.delta", **self._where(), content_index=0, delta=text, logprobs=logprobs
            )
        )
        return out

    def feed(self, event: Event) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if isinstance(event, ReasoningDelta):
            if not event.text:
                return out
            if not self._is_open("reasoning"):
                out += self._close()
                item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "status": "in_progress"}
                out += self._open(item)
            self.parts.append(event.text)
            out.append(
                self._event(
                    "response.reasoning_text.delta", **self._where(), content_index=0, delta=event.text
                )
            )
        elif isinstance(event, TextDelta):
            out += self._text(event.text, logprob_entries(event.logprobs))
        elif isinstance(event, ToolCallStart):
            out += self._close()
            self.held = ""
            out += self._open(self._call_item(event))
        elif isinstance(event, ToolCallArgs) and self._is_open("custom_tool_call"):
            self.parts.append(event.delta)
        elif isinstance(event, ToolCallArgs) and self._is_open("function_call") and event.delta:
            self.parts.append(event.delta)
            out.append(
                self._event("response.function_call_arguments.delta", **self._where(), delta=event.delta)
            )
        return out

    def _call_item(self, event: ToolCallStart) -> dict[str, Any]:
        origin = self.origins.get(event.name) or ToolOrigin(event.name)
        call_id = CALL_PREFIX + event.id
        if origin.custom:
            item = {"id": new_id("ctc_"), "type": "custom_tool_call", "status": "in_progress"}
            return {**item, "call_id": call_id, "name": origin.name, "input": ""}
        item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress", "call_id": call_id}
        item["name"] = origin.name
        if origin.namespace is not None:
            item["namespace"] = origin.namespace
        item["arguments"] = ""
        return item

    def finish(self, finish: Finish) -> list[dict[str, Any]]:
        truncated = finish.reason == "length"
        out: list[dict[str, Any]] = []
        has_answer = any(i["type"] in _ANSWERS for i in self.output)
        if self.held and not has_answer:  # whitespace was the whole answer: keep it
            out += self._text("", [], force=True)
        out += self._close("incomplete" if truncated else "completed")
        if not any(i["type"] in _ANSWERS for i in self.output):
            # Nothing but reasoning (or nothing at all): an empty message keeps output_text defined.
            out += self._text("", [], force=True)
            out += self._close("incomplete" if truncated else "completed")
        self.response["usage"] = usage_dict(finish.usage)
        self.response["completed_at"] = int(time.time())
        if truncated:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            out.append(self._event("response.incomplete", response=self._snapshot()))
        else:
            self.response["status"] = "completed"
            out.append(self._event("response.completed", response=self._snapshot()))
        return out

    def fail(self, exc: ApiError) -> list[dict[str, Any]]:
        code = "rate_limit_exceeded" if exc.kind is ErrorKind.OVERLOADED else "server_error"
        out = [self._event("error", code=code, message=exc.message, param=exc.param)]
        self.response["status"] = "failed"
        self.response["error"] = {"code": code, "message": exc.message}
        out.append(self._event("response.failed", response=self._snapshot()))
        return out


def _sse(event: dict[str, Any]) -> bytes:
    return sse_event(event["type"], event)


async def create_response(request: Request) -> Response:
    body = await read_json(request)
    chat, origins = parse_body(body)
    chat.cache_salt = cache_salt(request, body)
    plan = make_plan(chat, state_of(request).registry)
    reasoning = body.get("reasoning")
    summarize = isinstance(reasoning, dict) and reasoning.get("summary") not in (None, "none")
    builder = ResponseBuilder(response_skeleton(plan, body), summarize=summarize, origins=origins)

    if not chat.stream:
        # The builder is this API's accumulator: the same one renders the stream.
        for event in await until_disconnect(request, run_choice(plan)):
            builder.finish(event) if isinstance(event, Finish) else builder.feed(event)
        return Response(orjson.dumps(builder.response), media_type="application/json")

    events = await start_stream(request, plan, state_of(request).ping_interval)

    async def body_stream() -> AsyncIterator[bytes]:
        for opening in builder.start():
            yield _sse(opening)
        try:
            async for event in events:
                if isinstance(event, Ping):
                    yield SSE_PING
                    continue
                produced = builder.finish(event) if isinstance(event, Finish) else builder.feed(event)
                for item in produced:
                    yield _sse(item)
        except ApiError as exc:
            for item in builder.fail(exc):
                yield _sse(item)

    return sse_response(body_stream())


async def get_response(request: Request) -> Response:
    raise ApiError(
        ErrorKind.NOT_FOUND,
        f"response {request.path_params['response_id']!r} not found: this server stores no responses",
        param="response_id",
    )


def routes() -> list[Route]:
    wrap = endpoint(openai_error)
    return [
        Route("/v1/responses", wrap(create_response), methods=["POST"]),
        Route("/v1/responses/{response_id}", wrap(get_response), methods=["GET", "DELETE"]),
    ]
