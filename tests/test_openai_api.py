"""The OpenAI API, driven by the official openai SDK against a server on loopback."""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import pytest

from turbospark.engine.scheduler import SchedulerConfig
from turbospark.ratecontrol import RateControl
from turbospark.scripted import DEMO_REPLY, ScriptedChatModel
from turbospark.testing import LiveServer

GOLDEN = Path(__file__).parent / "golden"
MESSAGES = [{"role": "user", "content": "Say hello"}]


def client_for(server: LiveServer, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    with ExitStack() as st:
        yield st


@pytest.fixture
def client(scripted_server: LiveServer) -> Iterator[openai.OpenAI]:
    with client_for(scripted_server) as client:
        yield client


def test_non_streaming_reply(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="scripted", messages=MESSAGES)  # type: ignore[arg-type]
    choice = reply.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == DEMO_REPLY
    assert choice.finish_reason == "stop"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == len(DEMO_REPLY.encode())  # one byte per token
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_streaming_text_equals_non_streaming(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="scripted", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert all(c.usage is None for c in chunks)  # usage only when asked
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == DEMO_REPLY


def test_stream_usage_when_asked(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="scripted",
        messages=MESSAGES,  # type: ignore[arg-type]
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=7,
    )
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens == 7
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["length"]
    assert all(c.usage is None for c in chunks[:-1])


def test_alias_routes_to_backend(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="claude-turbospark-scripted", messages=MESSAGES)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == DEMO_REPLY
    assert reply.model == "claude-turbospark-scripted"


def test_models_list_and_get(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["scripted", "claude-turbospark-scripted"]
    assert client.models.retrieve("scripted").id == "scripted"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_stop_string_spanning_tokens(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="scripted", messages=MESSAGES, stop=["scripted demo"])  # type: ignore[arg-type]
    assert reply.choices[0].message.content == DEMO_REPLY.split("scripted demo")[0]
    assert reply.choices[0].finish_reason == "stop"


def test_n_choices_and_seed(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="scripted",
        messages=MESSAGES,  # type: ignore[arg-type]
        n=2,
        temperature=1.5,
        seed=7,
        max_tokens=5,
    )
    assert [c.index for c in reply.choices] == [0, 1]
    assert all(c.message.content == DEMO_REPLY[:5] for c in reply.choices)
    assert reply.usage is not None and reply.usage.completion_tokens == 10


def test_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="scripted",
        messages=MESSAGES,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=2,
        max_tokens=3,
    )
    content = reply.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None
    assert [e.token for e in content] == list(DEMO_REPLY[:3])
    for entry in content:
        assert entry.logprob == pytest.approx(0.0, abs=1e-6)
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token


def test_tool_call_streaming_and_not_agree(stack: ExitStack) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        }
    ]
    with LiveServer([ScriptedChatModel([call])]) as server:
        client = stack.enter_context(client_for(server))
        reply = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=tools)  # type: ignore[arg-type]
        msg = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        assert msg.content is None
        assert msg.tool_calls is not None and len(msg.tool_calls) == 1
        fn = msg.tool_calls[0].function  # type: ignore[union-attr]
        assert (fn.name, json.loads(fn.arguments)) == ("get_weather", {"city": "Paris"})

        chunks = list(
            client.chat.completions.create(model="scripted", messages=MESSAGES, tools=tools, stream=True)
        )  # type: ignore[arg-type]
        deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].id and deltas[0].function and deltas[0].function.name == "get_weather"
        args = "".join(d.function.arguments or "" for d in deltas if d.function)
        assert json.loads(args) == {"city": "Paris"}
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_is_split_from_content(stack: ExitStack) -> None:
    reply_text = "<think>The user wants a greeting.</think>Hello!"
    with LiveServer([ScriptedChatModel([reply_text])]) as server:
        client = stack.enter_context(client_for(server))
        reply = client.chat.completions.create(model="scripted", messages=MESSAGES, reasoning_effort="high")  # type: ignore[arg-type]
        msg = reply.choices[0].message
        assert msg.content == "Hello!"
        assert (
            msg.model_extra is not None
            and msg.model_extra["reasoning_content"] == "The user wants a greeting."
        )
        chunks = list(client.chat.completions.create(model="scripted", messages=MESSAGES, stream=True))  # type: ignore[arg-type]
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        reasoning = "".join(
            (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
        )
        assert (content, reasoning) == ("Hello!", "The user wants a greeting.")


# ------------------------------------------------------------------ errors


def test_malformed_json_is_bad_request(scripted_server: LiveServer) -> None:
    def mangle(request: httpx.Request) -> None:
        request.stream = httpx.ByteStream(b'{"model": "scripted", "messages": [')
        request.headers["content-length"] = str(len(b'{"model": "scripted", "messages": ['))

    with (
        httpx.Client(event_hooks={"request": [mangle]}) as http,
        client_for(scripted_server, http_client=http) as client,
        pytest.raises(openai.BadRequestError) as info,
    ):
        client.chat.completions.create(model="scripted", messages=MESSAGES)  # type: ignore[arg-type]
    assert "not valid JSON" in info.value.message


@pytest.mark.parametrize(
    ("body", "field", "text"),
    [
        ({"model": "scripted"}, "messages", "'messages' is required"),
        ({"model": "scripted", "messages": []}, "messages", "at least one message"),
        ({"model": "scripted", "messages": "hi"}, "messages", "must be an array"),
        (
            {"model": "scripted", "messages": MESSAGES, "temperature": "hot"},
            "temperature",
            "must be a number",
        ),
        ({"model": "scripted", "messages": MESSAGES, "max_tokens": -1}, "max_tokens", "at least 1"),
        (
            {"model": "scripted", "messages": [{"role": "wizard", "content": "x"}]},
            "messages[0].role",
            "must be one of",
        ),
        (
            {"model": "scripted", "messages": MESSAGES, "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when 'stream' is true",
        ),
        ({"messages": MESSAGES}, "model", "'model' is required"),
        ({"model": "scripted", "messages": MESSAGES, "n": "2"}, "n", "must be an integer"),
        (
            {
                "model": "scripted",
                "messages": MESSAGES,
                "tool_choice": {"type": "function", "function": {"name": "x"}},
            },
            "tool_choice",
            "no tools",
        ),
    ],
)
def test_bad_requests_name_the_field(
    client: openai.OpenAI, body: dict[str, object], field: str, text: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/chat/completions", body=body, cast_to=object)
    assert text in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body.get("param") == field


def test_unknown_model_is_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-imaginary", messages=MESSAGES)  # type: ignore[arg-type]
    assert "gpt-imaginary" in info.value.message and "scripted" in info.value.message


def test_prompt_longer_than_context_is_bad_request(stack: ExitStack) -> None:
    with LiveServer([ScriptedChatModel(max_context=64)]) as server:
        client = stack.enter_context(client_for(server))
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="scripted", messages=[{"role": "user", "content": "x" * 100}]
            )
        assert "context of 64 tokens" in info.value.message


def test_image_to_textonly_model_is_refused_by_name(client: openai.OpenAI) -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 16).decode()
    content = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": content}])  # type: ignore[list-item,misc]
    assert "cannot read images" in info.value.message and "scripted" in info.value.message


def test_image_url_is_not_fetched(client: openai.OpenAI) -> None:
    content = [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}]
    with pytest.raises(openai.BadRequestError, match="does not fetch images"):
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": content}])  # type: ignore[list-item,misc]


def test_api_key_required_when_configured(stack: ExitStack) -> None:
    with LiveServer([ScriptedChatModel()], api_keys=["sekrit"]) as server:
        with pytest.raises(openai.AuthenticationError):
            stack.enter_context(client_for(server)).models.list()
        ok = stack.enter_context(openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0))
        assert next(m.id for m in ok.models.list()) == "scripted"
        assert httpx.get(server.url + "/health").status_code == 200  # health stays open


# ------------------------------------------------------------------ queue and cancellation


def slow_backend(rate: float, reply_len: int = 400) -> tuple[ScriptedChatModel, RateControl]:
    control = RateControl(rate)
    scheduler = SchedulerConfig(max_active=1, max_waiting=0, retry_after=2)
    backend = ScriptedChatModel(["z" * reply_len], scheduler=scheduler, rate=control)
    return backend, control


def test_full_queue_answers_429_with_retry_after(stack: ExitStack) -> None:
    backend, _ = slow_backend(rate=100)
    with LiveServer([backend]) as server:
        client = stack.enter_context(client_for(server))
        first = client.chat.completions.create(model="scripted", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        next(iter(first))  # the first request now holds the only slot
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="scripted", messages=MESSAGES)  # type: ignore[arg-type]
        assert info.value.response.headers["retry-after"] == "2"
        assert "capacity" in info.value.message
        first.close()


def test_client_disconnect_cancels_generation(stack: ExitStack) -> None:
    backend, control = slow_backend(rate=200, reply_len=2000)
    with LiveServer([backend]) as server:
        client = stack.enter_context(client_for(server))
        stream = client.chat.completions.create(model="scripted", messages=MESSAGES, stream=True)  # type: ignore[arg-type]
        it: Iterator[object] = iter(stream)
        for _ in range(5):
            next(it)
        stream.close()
        time.sleep(0.5)
        made = control.num_tokens
        time.sleep(0.5)
        assert control.num_tokens == made  # nothing more is generated once the client is gone
        assert made < 300  # 2000 would be the whole reply
        # and the slot is free again
        reply = client.chat.completions.create(model="scripted", messages=MESSAGES, max_tokens=3)  # type: ignore[arg-type]
        assert reply.choices[0].message.content == "zzz"


def test_non_streaming_disconnect_cancels_generation() -> None:
    backend, control = slow_backend(rate=200, reply_len=2000)
    with LiveServer([backend]) as server:
        body = {"model": "scripted", "messages": MESSAGES}
        done = threading.Event()

        def call() -> None:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
            done.set()

        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        assert done.is_set()
        time.sleep(0.5)
        made = control.num_tokens
        time.sleep(0.5)
        assert control.num_tokens == made and made < 400


# ------------------------------------------------------------------ golden stream


def normalise(stream: bytes) -> bytes:
    stream = re.sub(rb'"id":"chatcmpl-[0-9a-f]+"', b'"id":"chatcmpl-ID"', stream)
    return re.sub(rb'"created":\d+', b'"created":0', stream)


def test_golden_sse_stream() -> None:
    with LiveServer([ScriptedChatModel(["Hi ✓"])]) as server:
        body = {
            "model": "scripted",
            "messages": MESSAGES,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        raw = httpx.post(server.url + "/v1/chat/completions", json=body).content
    path = GOLDEN / "openai_chat_stream.sse"
    if os.environ.get("TURBOSPARK_UPDATE_GOLDEN"):
        path.write_bytes(normalise(raw))
    assert normalise(raw) == path.read_bytes()


def test_completions_endpoint(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="scripted", prompt="Once upon a time", max_tokens=5)
    assert reply.choices[0].text == DEMO_REPLY[:5]
    assert reply.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model="scripted", prompt="x", stream=True, max_tokens=500)
    )
    assert streamed == DEMO_REPLY
