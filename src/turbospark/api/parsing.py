"""Request parsers that several APIs share: OpenAI-shaped messages, content parts, function
tools, tool calls, tool_choice, reasoning effort and JSON output formats.

OpenAI chat, the Responses API, Ollama and `/tokenize` read these shapes; each parser reports a
bad field by its dotted path and leaves policy (is the named tool declared? does `required` have
tools?) to the plan step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from turbospark.api import fields as f
from turbospark.api.common import new_id
from turbospark.backend import ReasoningEffort
from turbospark.errors import invalid
from turbospark.request import (
    Message,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
    ToolChoice,
    ToolChoiceMode,
    empty_object_schema,
)

_EFFORTS = {
    "none": ReasoningEffort.OFF,
    "minimal": ReasoningEffort.LOW,
    "low": ReasoningEffort.LOW,
    "medium": ReasoningEffort.MEDIUM,
    "high": ReasoningEffort.HIGH,
    "xhigh": ReasoningEffort.HIGH,
}


def parse_effort(value: Any, where: str) -> ReasoningEffort | None:
    """OpenAI's `reasoning_effort` / Responses' `reasoning.effort`."""
    if value is None:
        return None
    if not isinstance(value, str) or value not in _EFFORTS:
        raise invalid(f"'{where}' must be one of {', '.join(_EFFORTS)}, got {value!r}", where)
    return _EFFORTS[value]


def parse_temperature_top_p(body: dict[str, Any], *, max_temperature: float) -> SamplingParams:
    """Sampling with the caller's `temperature` and `top_p` (each None, the served model's
    default, when not sent or null)."""
    sp = SamplingParams()
    sp.temperature = f.number(body, "temperature", minimum=0.0, maximum=max_temperature)
    sp.top_p = f.number(body, "top_p", minimum=0.0, maximum=1.0)
    return sp


def parse_tool_fields(body: dict[str, Any], *, nested: bool) -> dict[str, Any]:
    """`tools`, `tool_choice` and `parallel_tool_calls` as `ChatRequest` keyword arguments."""
    return {
        "tools": parse_function_tools(body.get("tools"), nested=nested),
        "tool_choice": parse_tool_choice(body.get("tool_choice")),
        "parallel_tool_calls": f.boolean(body, "parallel_tool_calls", True),
    }


_TEXT_PARTS = ("text", "input_text", "output_text", "summary_text", "reasoning_text")
_IMAGE_PARTS = ("image_url", "input_image")


def read_content(content: Any, where: str, msg: Message) -> None:
    """A string, or content parts (text, refusal, images as data URIs) into `msg`."""
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
        if kind in _TEXT_PARTS:
            texts.append(f.string(part, "text", f"{pw}.text", required=True) or "")
        elif kind == "refusal":
            texts.append(f.string(part, "refusal", f"{pw}.refusal") or "")
        elif kind in _IMAGE_PARTS:
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str):
                raise invalid(
                    f"'{pw}.image_url' must be a data URI (or {{'url': data URI}}): this server keeps no "
                    "files and fetches nothing",
                    f"{pw}.image_url",
                )
            msg.images.append(f.decode_base64_image(url, f"{pw}.image_url"))
        else:
            raise invalid(
                f"'{pw}.type' {kind!r} is not supported; use a text part or an image part "
                f"({', '.join(_IMAGE_PARTS)})",
                f"{pw}.type",
            )
    msg.content = "".join(texts)


def parse_tool_calls(raw: Any, where: str, default_id: Callable[[int], str]) -> list[ToolCall]:
    """`[{id?, function: {name, arguments}}]`; arguments a JSON object or its JSON text."""
    calls = []
    for i, (iw, item) in enumerate(f.objects(raw, where)):
        fn = f.obj(item, "function", f"{iw}.function", required=True) or {}
        name = f.string(fn, "name", f"{iw}.function.name", required=True) or ""
        call_id = f.string(item, "id", f"{iw}.id") or default_id(i)
        calls.append(
            ToolCall(call_id, name, _arguments_text(fn.get("arguments"), f"{iw}.function.arguments"))
        )
    return calls


def _arguments_text(args: Any, where: str) -> str:
    if isinstance(args, str):
        if not args.strip():
            return "{}"
        try:
            parsed = orjson.loads(args)
        except orjson.JSONDecodeError as exc:
            raise invalid(f"'{where}' is not valid JSON: {exc}", where) from exc
        if isinstance(parsed, dict):
            return args
        args = parsed
    if args is None:
        return "{}"
    if not isinstance(args, dict):
        raise invalid(f"'{where}' must be a JSON object (or its JSON text)", where)
    return orjson.dumps(args).decode()


def random_call_id(_: int) -> str:
    return new_id("call_")


def parse_function_tools(raw: Any, *, nested: bool) -> list[Tool]:
    """Function tools: `{type: function, function: {name, ...}}` (OpenAI chat, Ollama; `nested`)
    or `{type: function, name, ...}` (Responses)."""
    tools = []
    for where, item in f.objects(raw, "tools"):
        kind = f.string(item, "type", f"{where}.type") or "function"
        if kind != "function":
            raise invalid(
                f"'{where}.type' {kind!r} is not supported: this server runs no hosted tools; "
                "declare your tools as type 'function'",
                f"{where}.type",
            )
        fw = f"{where}.function" if nested else where
        fn = (f.obj(item, "function", fw, required=True) or {}) if nested else item
        tools.append(
            Tool(
                name=f.string(fn, "name", f"{fw}.name", required=True) or "",
                description=f.string(fn, "description", f"{fw}.description") or "",
                parameters=f.obj(fn, "parameters", f"{fw}.parameters") or empty_object_schema(),
                strict=f.boolean(fn, "strict", False, f"{fw}.strict"),
            )
        )
    return tools


_CHOICE_MODES = {
    "auto": ToolChoiceMode.AUTO,
    "none": ToolChoiceMode.NONE,
    "required": ToolChoiceMode.REQUIRED,
}


def parse_tool_choice(raw: Any) -> ToolChoice:
    """OpenAI's and Responses' `tool_choice`: a mode, or `{type: function, function: {name}}` /
    `{type: function, name}`."""
    if raw is None:
        return ToolChoice()
    if isinstance(raw, str):
        if raw not in _CHOICE_MODES:
            raise invalid(
                f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {raw!r}", "tool_choice"
            )
        return ToolChoice(_CHOICE_MODES[raw], as_written=raw)
    if not isinstance(raw, dict):
        raise invalid("'tool_choice' must be a string or an object", "tool_choice")
    kind = raw.get("type", "function")
    if kind != "function":
        raise invalid(
            f"'tool_choice.type' {kind!r} is not supported; use {{'type': 'function', 'name': ...}}",
            "tool_choice.type",
        )
    fn = raw.get("function")
    where = "tool_choice.function.name" if isinstance(fn, dict) else "tool_choice.name"
    name = fn.get("name") if isinstance(fn, dict) else raw.get("name")
    if not isinstance(name, str):
        raise invalid(f"'{where}' must be a string", "tool_choice")
    return ToolChoice(ToolChoiceMode.NAMED, name, where="tool_choice", as_written=name)


def parse_json_format(spec: dict[str, Any], where: str, schema_key: str | None) -> ResponseFormat | None:
    """`{type: text | json_object | json_schema, ...}`; the schema's fields sit under
    `schema_key` (OpenAI chat: "json_schema") or beside `type` (Responses: None)."""
    kind = f.string(spec, "type", f"{where}.type", required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        sw = f"{where}.{schema_key}" if schema_key else where
        holder = (f.obj(spec, schema_key, sw, required=True) or {}) if schema_key else spec
        return ResponseFormat(
            "json_schema",
            schema=f.obj(holder, "schema", f"{sw}.schema", required=schema_key is None) or {},
            name=f.string(holder, "name", f"{sw}.name"),
            strict=f.boolean(holder, "strict", False, f"{sw}.strict"),
        )
    raise invalid(f"'{where}.type' must be text, json_object or json_schema, got {kind!r}", f"{where}.type")


_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def parse_chat_messages(raw: Any) -> list[Message]:
    """OpenAI chat `messages` (also what `/tokenize` reads)."""
    out = []
    for where, item in f.required_objects(raw, "messages", "message"):
        role = f.string(item, "role", f"{where}.role", required=True)
        if role not in _ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", f"{where}.role")
        msg = Message(role="tool" if role == "function" else role)  # type: ignore[arg-type]
        if item.get("content") is not None:
            read_content(item["content"], f"{where}.content", msg)
        if role == "assistant":
            msg.tool_calls = parse_tool_calls(item.get("tool_calls"), f"{where}.tool_calls", random_call_id)
            reasoning = item.get("reasoning_content", item.get("reasoning"))
            msg.reasoning = reasoning if isinstance(reasoning, str) else None
        elif item.get("content") is None:
            raise invalid(f"'{where}.content' is required for role {role!r}", f"{where}.content")
        if role == "tool":
            msg.tool_call_id = f.string(item, "tool_call_id", f"{where}.tool_call_id")
        msg.name = f.string(item, "name", f"{where}.name")
        out.append(msg)
    return out
