"""The Ollama wire format byte by byte (NDJSON framing, field sets) and its request parsing."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from turbospark.api.ollama import (
    ollama_name,
    parse_chat_request,
    parse_generate_request,
    parse_keep_alive,
    parse_think,
)
from turbospark.backend import ModelDetails, ReasoningEffort
from turbospark.engine.scheduler import SchedulerConfig
from turbospark.errors import ApiError
from turbospark.ratecontrol import RateControl
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
FINAL_KEYS = {
    "model",
    "created_at",
    "message",
    "done",
    "done_reason",
    "total_duration",
    "load_duration",
    "prompt_eval_count",
    "prompt_eval_duration",
    "eval_count",
    "eval_duration",
}


def lines_of(response: httpx.Response) -> list[dict[str, object]]:
    assert response.text.endswith("\n")
    return [json.loads(line) for line in response.text.splitlines()]


def test_stream_is_the_default_and_is_ndjson() -> None:
    with LiveServer([ScriptedChatModel(["Hi!"])]) as server:
        reply = httpx.post(server.url + "/api/chat", json={"model": "scripted", "messages": ASK})
    assert reply.status_code == 200
    assert reply.headers["content-type"] == "application/x-ndjson"
    lines = lines_of(reply)
    assert [line["message"] for line in lines[:-1]] == [
        {"role": "assistant", "content": "H"},
        {"role": "assistant", "content": "i"},
        {"role": "assistant", "content": "!"},
    ]
    assert all(set(line) == {"model", "created_at", "message", "done"} for line in lines[:-1])
    final = lines[-1]
    assert set(final) == FINAL_KEYS
    assert final["done"] is True and final["done_reason"] == "stop"
    assert final["message"] == {"role": "assistant", "content": ""}
    assert final["eval_count"] == 3
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int) and final[key] > 0  # nanoseconds
    assert str(final["created_at"]).endswith("Z")


def test_stream_false_is_one_object() -> None:
    with LiveServer([ScriptedChatModel(["<think>Hmm.</think>Hi!"])]) as server:
        reply = httpx.post(
            server.url + "/api/chat", json={"model": "scripted", "messages": ASK, "stream": False}
        )
        generated = httpx.post(
            server.url + "/api/generate", json={"model": "scripted", "prompt": "x", "stream": False}
        )
    assert reply.headers["content-type"] == "application/json"
    body = reply.json()
    assert set(body) == FINAL_KEYS
    assert body["message"] == {"role": "assistant", "content": "Hi!", "thinking": "Hmm."}
    gen = generated.json()
    assert set(gen) == (FINAL_KEYS - {"message"}) | {"response", "thinking"}
    assert gen["response"] == "Hi!" and gen["thinking"] == "Hmm."


def test_tool_call_wire_shape() -> None:
    with LiveServer([ScriptedChatModel([WEATHER_CALL])]) as server:
        body = {"model": "scripted", "messages": ASK, "tools": [WEATHER_TOOL], "stream": False}
        reply = httpx.post(server.url + "/api/chat", json=body).json()
        streamed = lines_of(httpx.post(server.url + "/api/chat", json={**body, "stream": True}))
    (call,) = reply["message"]["tool_calls"]
    assert call["function"] == {"index": 0, "name": "get_weather", "arguments": {"city": "Paris", "days": 2}}
    assert call["id"].startswith("call_")
    assert reply["done_reason"] == "stop"
    with_calls = [line for line in streamed if line["message"].get("tool_calls")]  # type: ignore[union-attr]
    assert len(with_calls) == 1 and with_calls[0]["done"] is False
    (streamed_call,) = with_calls[0]["message"]["tool_calls"]  # type: ignore[index]
    assert streamed_call["function"] == call["function"]


def test_logprobs_when_asked() -> None:
    with LiveServer([ScriptedChatModel(["ab"])]) as server:
        body = {"model": "scripted", "messages": ASK, "stream": False, "logprobs": True, "top_logprobs": 2}
        reply = httpx.post(server.url + "/api/chat", json=body).json()
    assert [e["token"] for e in reply["logprobs"]] == ["a", "b"]
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in reply["logprobs"])


def test_litellm_shaped_history_links_results_to_calls() -> None:
    # LiteLLM sends `images: []` on every message, tool results with `tool_call_id` and no name,
    # and arguments as objects; the template must still see one consistent conversation.
    backend = ScriptedChatModel(["Sunny."])
    history = [
        {"role": "user", "content": "Weather in Paris?", "images": []},
        {
            "role": "assistant",
            "content": "",
            "images": [],
            "tool_calls": [
                {"id": "call_1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "content": "18C", "tool_call_id": "call_1", "images": []},
    ]
    with LiveServer([backend]) as server:
        body = {"model": "scripted", "messages": history, "tools": [WEATHER_TOOL], "stream": False}
        assert httpx.post(server.url + "/api/chat", json=body).json()["message"]["content"] == "Sunny."
    prompt = backend.tokenizer.decode(backend.prompts[0], skip_special_tokens=False)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18C\n</tool_response>" in prompt


def test_tool_results_get_their_call() -> None:
    calls = [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"function": {"name": "get_time", "arguments": {"zone": "CET"}}},
    ]
    request, _ = parse_chat_request(
        {
            "model": "m",
            "messages": [
                *ASK,
                {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "content": "12:00", "tool_name": "get_time"},
                {"role": "tool", "content": "18C"},  # no name: the call still open
            ],
        }
    )
    assistant, time_result, weather_result = request.messages[1:]
    by_name = {c.name: c.id for c in assistant.tool_calls}
    assert (time_result.name, time_result.tool_call_id) == ("get_time", by_name["get_time"])
    assert (weather_result.name, weather_result.tool_call_id) == ("get_weather", by_name["get_weather"])
    assert json.loads(assistant.tool_calls[0].arguments) == {"city": "Paris"}


def test_options_map_to_the_request() -> None:
    request, keep_alive = parse_chat_request(
        {
            "model": "qwen:latest",
            "messages": ASK,
            "think": False,
            "format": {"type": "object"},
            "keep_alive": "1h30m",
            "options": {
                "num_predict": 64,
                "temperature": 0.2,
                "top_k": 20,
                "top_p": 0.8,
                "min_p": 0.1,
                "seed": 3,
                "stop": "END",
                "repeat_penalty": 1.2,
                "presence_penalty": 0.3,
                "frequency_penalty": 0.4,
            },
        }
    )
    sp = request.sampling
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed) == (0.2, 20, 0.8, 0.1, 3)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty) == (1.2, 0.3, 0.4)
    assert request.max_tokens == 64 and request.stop == ["END"]
    assert request.reasoning_effort is ReasoningEffort.OFF
    assert request.response_format is not None and request.response_format.type == "json_schema"
    assert request.response_format.schema == {"type": "object"}
    assert request.stream is True and keep_alive == 5400.0

    unlimited, _ = parse_chat_request(
        {"model": "m", "messages": ASK, "format": "json", "options": {"num_predict": -1, "seed": -1}}
    )
    assert unlimited.max_tokens is None and unlimited.sampling.seed is None
    assert unlimited.response_format is not None and unlimited.response_format.type == "json_object"
    assert unlimited.reasoning_effort is None  # the model's default


def test_generate_parsing() -> None:
    templated, _ = parse_generate_request({"model": "m", "prompt": "Hi", "system": "Terse."})
    assert [(m.role, m.content) for m in templated.messages] == [("system", "Terse."), ("user", "Hi")]
    assert templated.prompt is None
    raw, _ = parse_generate_request({"model": "m", "prompt": "<s>Hi", "raw": True})
    assert raw.prompt == "<s>Hi" and raw.messages == []
    with pytest.raises(ApiError, match="raw"):
        parse_generate_request({"model": "m", "prompt": "x", "raw": True, "system": "y"})
    with pytest.raises(ApiError, match="template"):
        parse_generate_request({"model": "m", "prompt": "x", "template": "{{ .Prompt }}"})
    empty_context, _ = parse_generate_request({"model": "m", "prompt": "x", "context": []})
    assert empty_context.messages[-1].content == "x"


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [(None, None), (0, 0.0), (300, 300.0), ("-1", -1.0), ("5m", 300.0), ("1h30m", 5400.0), ("250ms", 0.25)],
)
def test_keep_alive_durations(raw: object, seconds: float | None) -> None:
    assert parse_keep_alive(raw) == seconds


def test_think_values() -> None:
    assert parse_think(True) is ReasoningEffort.MEDIUM
    assert parse_think(False) is ReasoningEffort.OFF
    assert parse_think("low") is ReasoningEffort.LOW
    assert parse_think("high") is ReasoningEffort.HIGH
    with pytest.raises(ApiError):
        parse_think("on")


def test_names_as_ollama_lists_them() -> None:
    assert ollama_name("scripted") == "scripted:latest"
    assert ollama_name("qwen2.5-coder:0.5b") == "qwen2.5-coder:0.5b"
    assert ollama_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M:latest"
    with LiveServer([ScriptedChatModel(["ok"], model_id="qwen2.5-coder:0.5b")]) as server:
        names = [m["name"] for m in httpx.get(server.url + "/api/tags").json()["models"]]
        assert names == ["qwen2.5-coder:0.5b"]
        body = {"model": names[0], "prompt": "x", "stream": False}
        assert httpx.post(server.url + "/api/generate", json=body).json()["response"] == "ok"


class DescribedScripted(ScriptedChatModel):
    """A scripted model that states its facts, as a loaded checkpoint does."""

    def details(self) -> ModelDetails:
        return ModelDetails("qwen2", "gguf", 494_032_768, "Q4_K_M", 397_808_192)


def test_model_details_clients_read() -> None:
    with LiveServer([DescribedScripted(model_id="coder", max_context=2048)]) as server:
        (tagged,) = httpx.get(server.url + "/api/tags").json()["models"]
        shown = httpx.post(server.url + "/api/show", json={"model": "coder"}).json()
        (running,) = httpx.get(server.url + "/api/ps").json()["models"]
    details = {
        "parent_model": "",
        "format": "gguf",
        "family": "qwen2",
        "families": ["qwen2"],
        "parameter_size": "494.0M",
        "quantization_level": "Q4_K_M",
    }
    assert tagged["details"] == shown["details"] == running["details"] == details
    assert tagged["size"] == running["size"] == 397_808_192 and running["size_vram"] == 0
    # Editors size their prompts from the architecture's context length.
    assert shown["model_info"]["qwen2.context_length"] == 2048 == running["context_length"]
    assert shown["model_info"]["general.architecture"] == "qwen2"
    assert shown["model_info"]["general.parameter_count"] == 494_032_768


def slow_backend(reply_len: int = 2000) -> tuple[ScriptedChatModel, RateControl]:
    control = RateControl(200)
    scheduler = SchedulerConfig(max_active=1, max_waiting=0, retry_after=2)
    backend = ScriptedChatModel(["z" * reply_len], scheduler=scheduler, rate=control)
    return backend, control


def test_disconnect_stops_generation_and_frees_the_slot() -> None:
    backend, control = slow_backend()
    with LiveServer([backend]) as server, httpx.Client(base_url=server.url) as client:
        body = {"model": "scripted", "messages": ASK}
        with client.stream("POST", "/api/chat", json=body) as reply:
            lines = reply.iter_lines()
            for _ in range(5):
                next(lines)
            # The only slot is taken: a second request is turned away, Ollama-shaped (Ollama's
            # own "server busy" status is 503).
            busy = httpx.post(server.url + "/api/chat", json={**body, "stream": False})
            assert busy.status_code == 503 and "error" in busy.json()
            assert busy.headers["retry-after"] == "2"
        time.sleep(0.5)
        made = control.num_tokens
        time.sleep(0.5)
        assert control.num_tokens == made < 300  # stopped, far short of the whole reply
        short = client.post("/api/chat", json={**body, "stream": False, "options": {"num_predict": 3}})
        assert short.json()["message"]["content"] == "zzz"

        with pytest.raises(httpx.ReadTimeout):
            client.post(
                "/api/generate", json={"model": "scripted", "prompt": "x", "stream": False}, timeout=0.5
            )
        time.sleep(0.5)
        made = control.num_tokens
        time.sleep(0.5)
        assert control.num_tokens == made
