"""The Ollama API, driven by the official `ollama` Python client against a server on loopback."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator, Sequence

import httpx
import ollama
import pytest

from turbospark.backend import CancelFlag, CompletionResult, GenerationConfig, ProgressCallback, RequestImage
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def serve(*replies: str) -> tuple[LiveServer, ScriptedChatModel]:
    backend = ScriptedChatModel(list(replies))
    return LiveServer([backend]), backend


def prompt_text(backend: ScriptedChatModel, index: int = -1) -> str:
    return backend.tokenizer.decode(backend.prompts[index], skip_special_tokens=False)


def num_tokens(backend: ScriptedChatModel, text: str) -> int:
    return len(backend.tokenizer.encode(text))


@pytest.fixture
def thinking() -> Iterator[tuple[ollama.Client, ScriptedChatModel]]:
    server, backend = serve("<think>Paris is in France.</think>It is sunny.")
    with server, ollama.Client(host=server.url) as client:
        yield client, backend


def test_chat_splits_thinking_and_reports_counts(thinking: tuple[ollama.Client, ScriptedChatModel]) -> None:
    client, backend = thinking
    reply = client.chat(model="scripted", messages=ASK)
    assert reply.message.role == "assistant"
    assert reply.message.content == "It is sunny."
    assert reply.message.thinking == "Paris is in France."
    assert reply.done is True and reply.done_reason == "stop"
    assert reply.prompt_eval_count == len(backend.prompts[0])
    assert reply.eval_count == num_tokens(backend, "<think>Paris is in France.</think>It is sunny.")
    durations = [reply.load_duration, reply.prompt_eval_duration, reply.eval_duration]
    assert all(isinstance(d, int) and d > 0 for d in durations)
    assert reply.total_duration is not None and reply.total_duration >= sum(d or 0 for d in durations) - 3


def test_chat_stream_ends_with_one_done_line(thinking: tuple[ollama.Client, ScriptedChatModel]) -> None:
    client, backend = thinking
    parts = list(client.chat(model="scripted", messages=ASK, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert len(parts) > 5  # token by token, not one blob
    assert "".join(p.message.content or "" for p in parts) == "It is sunny."
    assert "".join(p.message.thinking or "" for p in parts) == "Paris is in France."
    last = parts[-1]
    assert last.done_reason == "stop"
    assert last.message.content == ""
    assert last.eval_count == num_tokens(backend, "<think>Paris is in France.</think>It is sunny.")
    assert last.prompt_eval_count == len(backend.prompts[0])
    assert all(p.model == "scripted" for p in parts)


def test_async_client_stream_and_not() -> None:
    server, _ = serve("Bonjour!")

    async def run(url: str) -> tuple[str, str]:
        async with ollama.AsyncClient(host=url) as client:
            whole = await client.chat(model="scripted", messages=ASK)
            streamed = [p async for p in await client.chat(model="scripted", messages=ASK, stream=True)]
            gen = await client.generate(model="scripted", prompt="Say hello")
        assert gen.response == "Bonjour!" and gen.done_reason == "stop"
        return whole.message.content or "", "".join(p.message.content or "" for p in streamed)

    with server:
        assert asyncio.run(run(server.url)) == ("Bonjour!", "Bonjour!")


def test_tool_call_round_trip() -> None:
    server, backend = serve(WEATHER_CALL, "It is 18 degrees and sunny in Paris.")
    with server, ollama.Client(host=server.url) as client:
        first = client.chat(model="scripted", messages=ASK, tools=[WEATHER_TOOL])
        calls = first.message.tool_calls
        assert calls is not None and len(calls) == 1
        assert calls[0].function.name == "get_weather"
        assert calls[0].function.arguments == {"city": "Paris"}  # an object, never a string
        assert first.message.content == ""
        assert first.done_reason == "stop"
        assert '"name": "get_weather"' in prompt_text(backend, 0)  # the tool reached the template

        history = [
            *ASK,
            first.message,
            {"role": "tool", "content": "18 degrees, sunny", "tool_name": "get_weather"},
        ]
        second = client.chat(model="scripted", messages=history, tools=[WEATHER_TOOL])
        assert second.message.content == "It is 18 degrees and sunny in Paris."
        assert second.message.tool_calls is None
        prompt = prompt_text(backend, 1)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
        assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt


def test_streamed_tool_call_arrives_whole() -> None:
    two_calls = WEATHER_CALL + "\n" + WEATHER_CALL.replace("Paris", "Lyon")
    server, _ = serve(two_calls)
    with server, ollama.Client(host=server.url) as client:
        parts = list(client.chat(model="scripted", messages=ASK, tools=[WEATHER_TOOL], stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon"}),
    ]
    assert parts[-1].done and parts[-1].done_reason == "stop"


def test_empty_tools_list_is_plain_chat() -> None:
    # The client always sends `tools: []`; the reply must stay plain text.
    server, backend = serve(WEATHER_CALL)
    with server, ollama.Client(host=server.url) as client:
        reply = client.chat(model="scripted", messages=ASK, tools=[])
    assert reply.message.tool_calls is None
    assert reply.message.content == WEATHER_CALL
    assert "# Tools" not in prompt_text(backend)


def test_generate_templates_the_prompt_unless_raw() -> None:
    server, backend = serve("Hi.")
    with server, ollama.Client(host=server.url) as client:
        reply = client.generate(model="scripted", prompt="Say hi", system="Be brief.")
        assert reply.response == "Hi." and reply.done and reply.done_reason == "stop"
        assert prompt_text(backend, 0).startswith(
            "<|im_start|>system\nBe brief.<|im_end|>\n"
            "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
        )
        raw = client.generate(model="scripted", prompt="Q: 2+2?\nA:", raw=True)
        assert raw.response == "Hi."
        assert prompt_text(backend, 1) == "Q: 2+2?\nA:"
        parts = list(client.generate(model="scripted", prompt="Say hi", stream=True))
        assert "".join(p.response or "" for p in parts) == "Hi."
        assert parts[-1].done and parts[-1].eval_count == num_tokens(backend, "Hi.")


def test_think_switches_reasoning() -> None:
    server, backend = serve("<think>Short.</think>Done.")
    with server, ollama.Client(host=server.url) as client:
        off = client.generate(model="scripted", prompt="Go", think=False)
        assert prompt_text(backend, 0).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        # Even when a model thinks regardless, the reasoning never lands in the answer.
        assert off.response == "Done." and off.thinking == "Short."
        on = client.chat(model="scripted", messages=ASK, think="high")
        assert prompt_text(backend, 1).endswith("<|im_start|>assistant\n")
        assert on.message.thinking == "Short." and on.message.content == "Done."


def test_options_reach_generation() -> None:
    server, _ = serve("one two three four five six")
    with server, ollama.Client(host=server.url) as client:
        short = client.chat(model="scripted", messages=ASK, options={"num_predict": 5, "temperature": 0})
        assert short.message.content == "one t"
        assert short.done_reason == "length" and short.eval_count == 5
        stopped = client.generate(model="scripted", prompt="x", options={"stop": ["four"], "seed": 7})
        assert stopped.response == "one two three " and stopped.done_reason == "stop"
        everything = client.generate(
            model="scripted",
            prompt="x",
            options={
                "num_predict": -1,
                "num_ctx": 8192,
                "top_k": 40,
                "top_p": 0.9,
                "min_p": 0.05,
                "repeat_penalty": 1.1,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.5,
                "seed": -1,
                "num_thread": 2,
                "mirostat": 0,
            },
            keep_alive="10m",
        )
        assert everything.response == "one two three four five six"


def test_format_is_accepted() -> None:
    server, _ = serve('{"city": "Paris"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    with server, ollama.Client(host=server.url) as client:
        assert (
            client.chat(model="scripted", messages=ASK, format="json").message.content == '{"city": "Paris"}'
        )
        assert client.generate(model="scripted", prompt="x", format=schema).response == '{"city": "Paris"}'


def test_model_listing_show_ps_version() -> None:
    server, backend = serve("ok")
    with server, ollama.Client(host=server.url) as client:
        listed = client.list().models
        assert [m.model for m in listed] == ["scripted:latest"]
        assert listed[0].digest and listed[0].modified_at is not None
        # A listed name resolves back to the model.
        assert client.chat(model=listed[0].model or "", messages=ASK).message.content == "ok"

        shown = client.show("scripted:latest")
        assert shown.template == backend.tokenizer.chat_template
        assert shown.capabilities is not None
        assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
        assert "vision" not in shown.capabilities
        assert shown.modelinfo is not None
        context = [v for k, v in shown.modelinfo.items() if k.endswith(".context_length")]
        assert context == [backend.max_context]
        assert shown.parameters is not None and f"num_ctx {backend.max_context}" in shown.parameters

        running = client.ps().models
        assert [m.model for m in running] == ["scripted:latest"]
        assert running[0].context_length == backend.max_context

        assert httpx.get(server.url + "/api/version").json()["version"].count(".") == 2
        root = httpx.get(server.url + "/")
        assert root.status_code == 200 and root.text == "Ollama is running"
        head = httpx.head(server.url + "/")
        assert head.status_code == 200 and head.content == b""


def test_show_accepts_the_older_name_field() -> None:
    server, _ = serve("ok")
    with server:
        shown = httpx.post(server.url + "/api/show", json={"name": "scripted"})
        assert shown.status_code == 200
        assert "completion" in shown.json()["capabilities"]
        missing = httpx.post(server.url + "/api/show", json={})
        assert missing.status_code == 400 and "model" in missing.json()["error"]


def test_errors_are_ollama_shaped() -> None:
    server, _ = serve("ok")
    with server, ollama.Client(host=server.url) as client:
        with pytest.raises(ollama.ResponseError) as not_found:
            client.chat(model="no-such-model", messages=ASK)
        assert not_found.value.status_code == 404
        assert "no-such-model" in not_found.value.error
        with pytest.raises(ollama.ResponseError) as streaming_not_found:
            list(client.chat(model="no-such-model", messages=ASK, stream=True))
        assert streaming_not_found.value.status_code == 404
        with pytest.raises(ollama.ResponseError) as bad_option:
            client.chat(model="scripted", messages=ASK, options={"temperature": "hot"})
        assert bad_option.value.status_code == 400
        assert "options.temperature" in bad_option.value.error
        with pytest.raises(ollama.ResponseError) as not_found_show:
            client.show("no-such-model")
        assert not_found_show.value.status_code == 404

        picture = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 32).decode()
        with pytest.raises(ollama.ResponseError) as image:
            client.chat(
                model="scripted", messages=[{"role": "user", "content": "What is this?", "images": [picture]}]
            )
        assert image.value.status_code == 400 and "image" in image.value.error

        for body, field in [
            ({"model": "scripted", "prompt": "x", "suffix": "y"}, "suffix"),
            ({"model": "scripted", "prompt": "x", "context": [1, 2]}, "context"),
            ({"model": "scripted", "prompt": "x", "think": "maximum"}, "think"),
            ({"model": "scripted", "prompt": "x", "format": "yaml"}, "format"),
            ({"model": "scripted", "prompt": "x", "keep_alive": "soon"}, "keep_alive"),
            ({"model": "scripted", "prompt": "x", "options": {"num_predict": 0}}, "num_predict"),
        ]:
            reply = httpx.post(server.url + "/api/generate", json={**body, "stream": False})
            assert reply.status_code == 400, body
            assert field in reply.json()["error"]
        bad_json = httpx.post(server.url + "/api/chat", content=b"{not json")
        assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]


class _FailsMidway(ScriptedChatModel):
    """Breaks after a few tokens, the way a device error would."""

    def run_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        seen = 0

        def progress(token: object) -> None:
            nonlocal seen
            seen += 1
            if seen > 3:
                raise RuntimeError("device lost")
            on_progress(token)  # type: ignore[arg-type]

        return super().run_completion(prompt_ids, config, images, cancel, progress)


def test_error_after_the_stream_started_is_an_error_line() -> None:
    with (
        LiveServer([_FailsMidway(["a long enough reply"])]) as server,
        ollama.Client(host=server.url) as client,
    ):
        received: list[str] = []
        with pytest.raises(ollama.ResponseError) as failure:
            for part in client.chat(model="scripted", messages=ASK, stream=True):
                received.append(part.message.content or "")
        assert "device lost" in failure.value.error
        assert "".join(received) == "a l"


def test_load_and_unload_requests() -> None:
    server, backend = serve("ok")
    with server:
        load = httpx.post(server.url + "/api/chat", json={"model": "scripted", "messages": []}).json()
        assert load["done"] is True and load["done_reason"] == "load"
        unload = httpx.post(server.url + "/api/generate", json={"model": "scripted", "keep_alive": 0}).json()
        assert unload["done_reason"] == "unload" and unload["response"] == ""
        missing = httpx.post(server.url + "/api/generate", json={"model": "nope"})
        assert missing.status_code == 404
    assert backend.prompts == []  # nothing was generated


def test_api_keys_guard_everything_but_the_probe() -> None:
    with LiveServer([ScriptedChatModel(["ok"])], api_keys=["secret"]) as server:
        with ollama.Client(host=server.url) as anonymous, pytest.raises(ollama.ResponseError) as denied:
            anonymous.chat(model="scripted", messages=ASK)
        assert denied.value.status_code == 401
        with ollama.Client(host=server.url, headers={"Authorization": "Bearer secret"}) as client:
            assert client.chat(model="scripted", messages=ASK).message.content == "ok"
        assert httpx.get(server.url + "/").status_code == 200
        assert httpx.get(server.url + "/api/version").status_code == 200
