"""Tool calls through the OpenAI API with the real client: streaming and non-streaming agree,
several calls get distinct ids and indexes, and tool_choice / response_format are enforced."""

from __future__ import annotations

import json
from typing import Any

import openai

from test_toolcalls_guardrails import repairing_server
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TWO_CALLS = (
    "<think>Two cities, two calls.</think>"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    "<tool_call>\n{'name': 'GetWeather', 'arguments': {'city': 'Oslo', 'days': '2'}}\n</tool_call>"
)


def _client(srv: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _streamed(client: openai.OpenAI, **kw: Any) -> dict[str, Any]:
    calls: dict[int, dict[str, Any]] = {}
    content, reasoning, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            reasoning += getattr(delta, "reasoning_content", None) or ""
            for tc in delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.id or slot["id"]
                if tc.function is not None:
                    slot["name"] += tc.function.name or ""
                    slot["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return {
        "content": content,
        "reasoning": reasoning,
        "calls": [calls[i] for i in sorted(calls)],
        "finish": finish,
    }


def test_streaming_and_non_streaming_give_the_same_calls() -> None:
    # TWO_CALLS is malformed on purpose (single quotes, a misspelt name, a string for an integer):
    # the repair path, which runs where the call constraint is off (`--no-constrained-calls`).
    with repairing_server(TWO_CALLS) as srv:
        client = _client(srv)
        kw: dict[str, Any] = {
            "model": "scripted",
            "messages": [{"role": "user", "content": "Weather in Paris and Oslo?"}],
            "tools": [WEATHER],
        }
        whole = client.chat.completions.create(**kw)
        streamed = _streamed(client, **kw)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" == streamed["finish"]
    assert message.content is None and streamed["content"] == ""
    assert getattr(message, "reasoning_content", None) == "Two cities, two calls." == streamed["reasoning"]
    got = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]
    expected = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert got == expected
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed["calls"]] == expected
    ids = [c.id for c in message.tool_calls or []] + [c["id"] for c in streamed["calls"]]
    assert len(set(ids)) == 4 and all(i.startswith("call_") for i in ids)


def test_tool_choice_required_and_json_schema_over_http() -> None:
    with LiveServer([ScriptedChatModel(["Happy to chat instead!"])]) as srv:
        client = _client(srv)
        for seed in range(3):
            reply = client.chat.completions.create(
                model="scripted",
                messages=[{"role": "user", "content": "Weather?"}],
                tools=[WEATHER],
                tool_choice="required",
                parallel_tool_calls=False,
                seed=seed,
                max_tokens=200,
            )
            calls = reply.choices[0].message.tool_calls or []
            assert reply.choices[0].finish_reason == "tool_calls" and len(calls) == 1
            args = json.loads(calls[0].function.arguments)
            assert isinstance(args["city"], str) and len(args["city"]) <= 20
        schema = {
            "type": "object",
            "properties": {
                "sunny": {"type": "boolean"},
                "temp": {"type": "integer", "minimum": -50, "maximum": 60},
            },
            "required": ["sunny", "temp"],
        }
        reply = client.chat.completions.create(
            model="scripted",
            messages=[{"role": "user", "content": "Weather?"}],
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": schema, "strict": True},
            },
            seed=7,
            max_tokens=200,
        )
        value = json.loads(reply.choices[0].message.content or "")
        assert set(value) == {"sunny", "temp"} and isinstance(value["sunny"], bool)
