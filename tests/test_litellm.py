"""LiteLLM's `ollama_chat/` and `openai/` routes against a server on loopback, fully offline.

LiteLLM reads its model cost map from the network unless LITELLM_LOCAL_MODEL_COST_MAP is set;
every test here also refuses any socket connection that is not to loopback, so a LiteLLM
change that starts phoning home fails loudly instead of hanging or leaking.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture
def litellm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    real_connect = socket.socket.connect

    def loopback_only(self: socket.socket, address: Any) -> None:
        host = address[0] if isinstance(address, tuple) else address
        if self.family in (socket.AF_INET, socket.AF_INET6) and host not in ("127.0.0.1", "::1", "localhost"):
            raise OSError(f"test tried to reach {address!r}; LiteLLM must stay offline")
        real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    yield litellm


def prompt_text(backend: ScriptedChatModel, index: int = -1) -> str:
    return backend.tokenizer.decode(backend.prompts[index], skip_special_tokens=False)


def test_ollama_chat_route(litellm: ModuleType) -> None:
    backend = ScriptedChatModel(["<think>Easy.</think>Sunny.", "Sunny."])
    with LiveServer([backend]) as server:
        reply = litellm.completion(model="ollama_chat/scripted", api_base=server.url, messages=ASK)
        streamed = list(
            litellm.completion(model="ollama_chat/scripted", api_base=server.url, messages=ASK, stream=True)
        )
    message = reply.choices[0].message
    assert message.content == "Sunny."
    assert message.reasoning_content == "Easy."  # `thinking` became LiteLLM's reasoning_content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(backend.prompts[0])
    assert reply.usage.completion_tokens == len(backend.tokenizer.encode("<think>Easy.</think>Sunny."))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Sunny."
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_ollama_chat_tool_round_trip(litellm: ModuleType) -> None:
    backend = ScriptedChatModel([WEATHER_CALL, WEATHER_CALL, "It is 18 degrees in Paris."])
    with LiveServer([backend]) as server:
        options: dict[str, Any] = {
            "model": "ollama_chat/scripted",
            "api_base": server.url,
            "tools": [WEATHER_TOOL],
        }
        first = litellm.completion(messages=ASK, **options)
        streamed = list(litellm.completion(messages=ASK, stream=True, **options))
        (call,) = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls"
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        streamed_calls = [t for c in streamed for t in (c.choices[0].delta.tool_calls or [])]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed_calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert streamed[-1].choices[0].finish_reason == "tool_calls"

        history = [
            *ASK,
            first.choices[0].message.model_dump(),
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees"},
        ]
        second = litellm.completion(messages=history, **options)
    assert second.choices[0].message.content == "It is 18 degrees in Paris."
    prompt = prompt_text(backend, 2)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 degrees\n</tool_response>" in prompt


def test_ollama_chat_options_and_async(litellm: ModuleType) -> None:
    backend = ScriptedChatModel(["one two three four"])
    with LiveServer([backend]) as server:
        cut = litellm.completion(
            model="ollama_chat/scripted",
            api_base=server.url,
            messages=ASK,
            max_tokens=3,
            temperature=0.2,
            top_p=0.9,
            seed=1,
            stop=["four"],
        )
        assert cut.choices[0].message.content == "one"
        assert cut.choices[0].finish_reason == "length"

        # response_format reaches the server as Ollama's `format` and is enforced by the grammar:
        # the scripted reply is not JSON, so the mask turns it into JSON.
        shaped = litellm.completion(
            model="ollama_chat/scripted",
            api_base=server.url,
            messages=ASK,
            max_tokens=3,
            response_format={"type": "json_object"},
        )
        assert str(shaped.choices[0].message.content).startswith("{")

        async def run() -> str:
            reply = await litellm.acompletion(model="ollama_chat/scripted", api_base=server.url, messages=ASK)
            return str(reply.choices[0].message.content)

        assert asyncio.run(run()) == "one two three four"


def test_ollama_model_info_comes_from_show(litellm: ModuleType) -> None:
    from litellm.llms.ollama.common_utils import OllamaModelInfo

    backend = ScriptedChatModel(["ok"], max_context=2048)
    with LiveServer([backend]) as server:
        info = OllamaModelInfo().get_runtime_model_info("ollama_chat/scripted", api_base=server.url)
    assert info["max_tokens"] == 2048
    assert info["supports_function_calling"] is True


def test_openai_route(litellm: ModuleType) -> None:
    backend = ScriptedChatModel(["Hello.", "Hello.", WEATHER_CALL])
    with LiveServer([backend]) as server:
        options: dict[str, Any] = {
            "model": "openai/scripted",
            "api_base": server.url + "/v1",
            "api_key": "unused",
        }
        reply = litellm.completion(messages=ASK, **options)
        streamed = list(litellm.completion(messages=ASK, stream=True, **options))
        with_tools = litellm.completion(messages=ASK, tools=[WEATHER_TOOL], **options)
    assert reply.choices[0].message.content == "Hello."
    assert reply.usage.prompt_tokens == len(backend.prompts[0])
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Hello."
    (call,) = with_tools.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert with_tools.choices[0].finish_reason == "tool_calls"


# LiteLLM's own TypedDicts trip a pydantic warning when its generate route builds a schema.
@pytest.mark.filterwarnings("ignore:.*using the `ReadOnly` qualifier:UserWarning")
def test_ollama_generate_route_and_responses_bridge(litellm: ModuleType) -> None:
    # Beyond the two required routes: `ollama/` goes through /api/generate, and
    # litellm.responses with an `openai/` model through /v1/responses.
    backend = ScriptedChatModel(["<think>Hm.</think>Hello."])
    with LiveServer([backend]) as server:
        generated = litellm.completion(model="ollama/scripted", api_base=server.url, messages=ASK)
        streamed = list(
            litellm.completion(model="ollama/scripted", api_base=server.url, messages=ASK, stream=True)
        )
        response = litellm.responses(
            model="openai/scripted", api_base=server.url + "/v1", api_key="unused", input="hi"
        )
    assert generated.choices[0].message.content == "Hello."
    assert generated.choices[0].message.reasoning_content == "Hm."
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == "Hello."
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[1].content[0].text == "Hello."
