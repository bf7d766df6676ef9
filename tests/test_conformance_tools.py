"""One get_weather tool conversation through every API: the same call back, the same prompt.

The conversation (system prompt, question, the model's call, the tool's result, the answer) is
sent through `/api/chat`, `/v1/chat/completions`, `/v1/responses` and `/v1/messages`, each by
its own official client: first turn streamed, first turn again not streamed, then the second
turn with the result. Every API must hand back the same call (name and arguments) and answer,
and must have rendered exactly the prompts the internal request renders: the wire formats
differ, the conversation the model sees does not.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from turbospark.plan import make_plan
from turbospark.registry import ModelRegistry
from turbospark.request import ChatRequest, Message, Tool, ToolCall
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

SYSTEM = "You are a weather assistant."
QUESTION = "What is the weather in Paris?"
RESULT = "18 degrees, sunny"
ANSWER = "It is 18 degrees and sunny in Paris."
DESCRIPTION = "Current weather in a city"
# Keys in the order the ollama client's Tool model dumps them, so its copy renders identically.
PARAMETERS = {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPT = [CALL, CALL, ANSWER]  # turn 1 streamed, turn 1 again, turn 2


@dataclass
class Outcome:
    streamed_call: tuple[str, dict[str, Any]]
    call: tuple[str, dict[str, Any]]
    answer: str


def via_ollama(url: str) -> Outcome:
    import ollama

    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS},
        }
    ]
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    with ollama.Client(host=url) as client:
        streamed = [
            c
            for part in client.chat(model="scripted", messages=ask, tools=tools, stream=True)
            for c in part.message.tool_calls or []
        ]
        first = client.chat(model="scripted", messages=ask, tools=tools)
        (call,) = first.message.tool_calls or []
        result = {"role": "tool", "content": RESULT, "tool_name": call.function.name}
        second = client.chat(model="scripted", messages=[*ask, first.message, result], tools=tools)
    (streamed_call,) = streamed
    return Outcome(
        (streamed_call.function.name, dict(streamed_call.function.arguments)),
        (call.function.name, dict(call.function.arguments)),
        second.message.content or "",
    )


def via_chat_completions(url: str) -> Outcome:
    import openai

    tools: Any = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": DESCRIPTION, "parameters": PARAMETERS},
        }
    ]
    ask: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        chunks = list(
            client.chat.completions.create(model="scripted", messages=ask, tools=tools, stream=True)
        )
        name = "".join(
            t.function.name or "" for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.function
        )
        args = "".join(
            t.function.arguments or ""
            for c in chunks
            for t in c.choices[0].delta.tool_calls or []
            if t.function
        )
        first = client.chat.completions.create(model="scripted", messages=ask, tools=tools)
        message = first.choices[0].message
        (call,) = message.tool_calls or []
        assert call.type == "function"
        result = {"role": "tool", "tool_call_id": call.id, "content": RESULT}
        history = [*ask, message.model_dump(exclude_none=True), result]
        second = client.chat.completions.create(model="scripted", messages=history, tools=tools)
    return Outcome(
        (name, json.loads(args)),
        (call.function.name, json.loads(call.function.arguments)),
        second.choices[0].message.content or "",
    )


def via_responses(url: str) -> Outcome:
    import openai

    tools: Any = [
        {
            "type": "function",
            "name": "get_weather",
            "description": DESCRIPTION,
            "parameters": PARAMETERS,
            "strict": False,
        }
    ]
    ask: Any = [{"role": "user", "content": QUESTION}]
    with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
        with client.responses.stream(model="scripted", instructions=SYSTEM, input=ask, tools=tools) as stream:
            (streamed,) = stream.get_final_response().output
        first = client.responses.create(model="scripted", instructions=SYSTEM, input=ask, tools=tools)
        (call,) = first.output
        assert streamed.type == "function_call" and call.type == "function_call"
        history = [
            *ask,
            call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": RESULT},
        ]
        second = client.responses.create(model="scripted", instructions=SYSTEM, input=history, tools=tools)
    return Outcome(
        (streamed.name, json.loads(streamed.arguments)),
        (call.name, json.loads(call.arguments)),
        second.output_text,
    )


def via_messages(url: str) -> Outcome:
    import anthropic

    tools: Any = [{"name": "get_weather", "description": DESCRIPTION, "input_schema": PARAMETERS}]
    ask: Any = [{"role": "user", "content": QUESTION}]
    options: Any = {"model": "scripted", "max_tokens": 1024, "system": SYSTEM, "tools": tools}
    with anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0) as client:
        with client.messages.stream(messages=ask, **options) as stream:
            streamed = [b for b in stream.get_final_message().content if b.type == "tool_use"]
        first = client.messages.create(messages=ask, **options)
        (call,) = [b for b in first.content if b.type == "tool_use"]
        history = [
            *ask,
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": RESULT}]},
        ]
        second = client.messages.create(messages=history, **options)
    (streamed_call,) = streamed
    return Outcome(
        (streamed_call.name, dict(streamed_call.input)),  # type: ignore[call-overload]
        (call.name, dict(call.input)),  # type: ignore[call-overload]
        "".join(b.text for b in second.content if b.type == "text"),
    )


def reference_prompts() -> list[str]:
    """What the internal request renders: the prompt every API must produce."""
    backend = ScriptedChatModel(SCRIPT)
    registry = ModelRegistry()
    registry.add(backend)
    tools = [Tool("get_weather", DESCRIPTION, PARAMETERS)]
    ask = [Message("system", SYSTEM), Message("user", QUESTION)]
    call = ToolCall("call_1", "get_weather", '{"city": "Paris"}')
    history = [
        *ask,
        Message("assistant", tool_calls=[call]),
        Message("tool", RESULT, tool_call_id="call_1", name="get_weather"),
    ]
    first = make_plan(ChatRequest("scripted", ask, tools=tools), registry).prompt_text
    second = make_plan(ChatRequest("scripted", history, tools=tools), registry).prompt_text
    return [first, first, second]


HAS_ANTHROPIC_API = importlib.util.find_spec("turbospark.api.anthropic") is not None

APIS = [
    pytest.param(via_ollama, id="ollama /api/chat"),
    pytest.param(via_chat_completions, id="openai /v1/chat/completions"),
    pytest.param(via_responses, id="openai /v1/responses"),
    pytest.param(
        via_messages,
        id="anthropic /v1/messages",
        marks=pytest.mark.skipif(not HAS_ANTHROPIC_API, reason="turbospark.api.anthropic is not importable"),
    ),
]


@pytest.mark.parametrize("conversation", APIS)
def test_same_tool_conversation(conversation: Callable[[str], Outcome]) -> None:
    backend = ScriptedChatModel(SCRIPT)
    with LiveServer([backend]) as server:
        outcome = conversation(server.url)
    expected_call = ("get_weather", {"city": "Paris"})
    assert outcome == Outcome(expected_call, expected_call, ANSWER)
    prompts = [backend.tokenizer.decode(p, skip_special_tokens=False) for p in backend.prompts]
    assert prompts == reference_prompts()
