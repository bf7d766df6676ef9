"""The official anthropic SDK against a loopback server: JSON and streaming, tools, thinking."""

from __future__ import annotations

import anthropic
import pytest

from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THINK_REPLY = "<think>The user greets me.</think>Bonjour, ça va ?"


def client(server: LiveServer, key: str = "k") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0)


def test_create_with_thinking() -> None:
    with LiveServer([ScriptedChatModel([THINK_REPLY])]) as server, client(server) as sdk:
        message = sdk.messages.create(
            model="scripted",
            max_tokens=200,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "salut"}],
        )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["thinking", "text"]
    thinking, text = message.content
    assert thinking.type == "thinking" and thinking.thinking == "The user greets me."
    assert thinking.signature  # opaque but present
    assert text.type == "text" and text.text == "Bonjour, ça va ?"
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_stream_with_thinking_matches_create() -> None:
    with LiveServer([ScriptedChatModel([THINK_REPLY])]) as server, client(server) as sdk:
        kwargs = {
            "model": "scripted",
            "max_tokens": 200,
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "salut"}],
        }
        plain = sdk.messages.create(**kwargs)
        with sdk.messages.stream(**kwargs) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "thinking" in kinds and "signature" in kinds and "text" in kinds
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in plain.content]
    assert streamed.stop_reason == plain.stop_reason == "end_turn"
    assert streamed.usage.output_tokens == plain.usage.output_tokens


def test_tool_round_trip_with_history_from_model_dump() -> None:
    backend = ScriptedChatModel([TOOL_REPLY, "It is sunny in Paris."])
    with LiveServer([backend]) as server, client(server) as sdk:
        messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Weather in Paris?"}]
        first = sdk.messages.create(model="scripted", max_tokens=300, tools=[WEATHER_TOOL], messages=messages)
        assert first.stop_reason == "tool_use"
        (call,) = first.content
        assert call.type == "tool_use" and call.id.startswith("toolu_")
        assert call.name == "get_weather" and call.input == {"city": "Paris"}
        # History exactly as SDK users build it: model_dump() with its null extras.
        messages.append({"role": "assistant", "content": [b.model_dump() for b in first.content]})
        messages.append(
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny, 24 C"}],
            }
        )
        with sdk.messages.stream(
            model="scripted", max_tokens=300, tools=[WEATHER_TOOL], messages=messages
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert text == "It is sunny in Paris."
    assert final.stop_reason == "end_turn"
    prompt = backend.tokenizer.decode(backend.prompts[1], skip_special_tokens=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\nsunny, 24 C\n</tool_response>" in prompt


def test_streamed_tool_use_input_json_deltas() -> None:
    request = {
        "model": "scripted",
        "max_tokens": 300,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "auto"},
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    with (
        LiveServer([ScriptedChatModel([TOOL_REPLY])]) as server,
        client(server) as sdk,
        sdk.messages.stream(**request) as stream,
    ):
        partials = [e.partial_json for e in stream if e.type == "input_json"]
        final = stream.get_final_message()
    assert partials and "".join(partials) == '{"city": "Paris"}'
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "tool_use" and final.content[0].input == {"city": "Paris"}


def test_count_tokens_matches_generation_prompt() -> None:
    backend = ScriptedChatModel(["ok"])
    with LiveServer([backend]) as server, client(server) as sdk:
        request = {
            "model": "scripted",
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [WEATHER_TOOL],
        }
        counted = sdk.messages.count_tokens(**request)
        made = sdk.messages.create(max_tokens=10, **request)
    assert counted.input_tokens == len(backend.prompts[0]) == made.usage.input_tokens


def test_models_list_has_claude_aliases() -> None:
    with LiveServer([ScriptedChatModel(model_id="tiny")]) as server, client(server) as sdk:
        ids = [m.id for m in sdk.models.list().data]
        one = sdk.models.retrieve("claude-turbospark-tiny")
    assert ids == ["tiny", "claude-turbospark-tiny"]
    assert one.id == "claude-turbospark-tiny" and one.type == "model"


def test_sdk_errors_map_to_sdk_exceptions() -> None:
    with LiveServer([ScriptedChatModel()], api_keys=["right"]) as server:
        with client(server, key="wrong") as sdk, pytest.raises(anthropic.AuthenticationError) as auth:
            sdk.messages.create(model="scripted", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
        with client(server, key="right") as sdk:
            with pytest.raises(anthropic.NotFoundError) as missing:
                sdk.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
            with pytest.raises(anthropic.BadRequestError) as bad:
                sdk.messages.create(model="scripted", max_tokens=5, messages=[])
    assert auth.value.status_code == 401
    assert auth.value.body["error"]["type"] == "authentication_error"
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "'nope'" in missing.value.body["error"]["message"]
    assert bad.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "'messages' must contain at least one message"},
    }


def test_sampling_fields_through_extra_body() -> None:
    with LiveServer([ScriptedChatModel(["deterministic"])]) as server, client(server) as sdk:
        message = sdk.messages.create(
            model="scripted",
            max_tokens=50,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 5},
        )
    assert message.content[0].text == "deterministic"
