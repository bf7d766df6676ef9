"""/v1/messages over plain HTTP: validation, auth, request shapes real clients send, stop
reasons, thinking, pings, overload and mid-stream errors."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
import pytest

from turbospark.api.anthropic import parse_messages_request
from turbospark.api.common import ServerState
from turbospark.backend import (
    CancelFlag,
    CompletionResult,
    FinishReason,
    GenerationConfig,
    ProgressCallback,
    ReasoningEffort,
    RequestImage,
    TokenEvent,
)
from turbospark.engine.scheduler import SchedulerConfig
from turbospark.plan import make_plan
from turbospark.registry import ModelRegistry
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

PNG_1X1 = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
        "0000000d49444154789c6360f8cfc00000030101001a2b8b6d0000000049454e44ae426082"
    )
).decode()
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "scripted", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **extra}


def post(
    server: LiveServer,
    payload: Any,
    path: str = "/v1/messages",
    headers: dict[str, str] | None = None,
) -> httpx.Response:
    content = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    base = {"content-type": "application/json", "anthropic-version": "2023-06-01"}
    return httpx.post(server.url + path, content=content, headers={**base, **(headers or {})}, timeout=30)


def sse(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) pairs; asserts every frame has both lines and they agree."""
    out = []
    for frame in text.strip().split("\n\n"):
        event_line, data_line = frame.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        data = orjson.loads(data_line[6:])
        assert data["type"] == event_line[7:]
        out.append((event_line[7:], data))
    return out


def prompt(backend: ScriptedChatModel, index: int = -1) -> str:
    return backend.tokenizer.decode(backend.prompts[index], skip_special_tokens=False)


def assert_invalid(response: httpx.Response, fragment: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error"
    assert error["error"]["type"] == "invalid_request_error"
    assert fragment in error["error"]["message"]


# ---------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def server() -> Any:
    with LiveServer([ScriptedChatModel(["fine"])]) as srv:
        yield srv


BAD_BODIES = [
    ({"max_tokens": None}, "'max_tokens' is required"),
    ({"max_tokens": 0}, "'max_tokens' must be at least 1"),
    ({"max_tokens": "many"}, "'max_tokens' must be an integer"),
    ({"model": None}, "'model' is required"),
    ({"messages": None}, "'messages' is required"),
    ({"messages": []}, "'messages' must contain at least one message"),
    ({"messages": {"role": "user"}}, "'messages' must be an array"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "'messages[0].role' must be 'user' or 'assistant'"),
    ({"messages": [{"content": "x"}]}, "'messages[0].role' is required"),
    ({"messages": [{"role": "user"}]}, "'messages[0].content' is required"),
    ({"messages": [{"role": "user", "content": []}]}, "'messages[0].content' must contain at least one"),
    ({"messages": [{"role": "user", "content": 7}]}, "'messages[0].content' must be a string or an array"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "'messages[0].content[0]' must be an object"),
    (
        {"messages": [{"role": "user", "content": [{"text": "hi"}]}]},
        "'messages[0].content[0].type' is required",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        "'messages[0].content[0].text' is required",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        "'messages[0].content[0].type' 'image_url' is not supported",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ]
        },
        "'messages[0].content[0].type' 'tool_use' is only allowed in assistant messages",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
        "'messages[0].content[0].tool_use_id' is required",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]},
                {"role": "user", "content": "go on"},
            ]
        },
        "'messages[1].content[0].input' must be an object",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}
            ]
        },
        "'messages[0].content[0].source' is a URL",
    ),
    ({"system": 5}, "'system' must be a string or an array of text blocks"),
    ({"system": [{"type": "image"}]}, "'system[0].type' must be 'text'"),
    ({"thinking": {"type": "sometimes"}}, "'thinking.type' must be enabled, adaptive or disabled"),
    ({"thinking": {"type": "enabled"}}, "'thinking.budget_tokens' is required"),
    ({"output_config": {"effort": "extreme"}}, "'output_config.effort' must be one of"),
    ({"temperature": 1.5}, "'temperature' must be at most 1"),
    ({"top_k": -1}, "'top_k' must be at least 0"),
    ({"stop_sequences": "END"}, "'stop_sequences' must be an array"),
    ({"stop_sequences": [""]}, "'stop_sequences[0]' must be a non-empty string"),
    ({"tools": [{"name": "f"}]}, "'tools[0].input_schema' is required"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'tools[0].type'"),
    ({"tool_choice": {"type": "any"}}, "'tool_choice.type' is 'any' but the request has no tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, "'tool_choice.name'"),
    ({"metadata": "x"}, "'metadata' must be an object"),
]


@pytest.mark.parametrize(("change", "fragment"), BAD_BODIES)
def test_bad_input_is_400_naming_the_field(server: LiveServer, change: dict[str, Any], fragment: str) -> None:
    payload = body()
    for key, value in change.items():
        if value is None:
            payload.pop(key, None)
        else:
            payload[key] = value
    assert_invalid(post(server, payload), fragment)


def test_body_that_is_not_json(server: LiveServer) -> None:
    assert_invalid(post(server, b"{not json"), "request body is not valid JSON")


def test_count_tokens_validates_too(server: LiveServer) -> None:
    assert_invalid(post(server, {"model": "scripted"}, "/v1/messages/count_tokens"), "'messages' is required")


def test_unknown_model_is_404_not_found_error(server: LiveServer) -> None:
    response = post(server, body(model="claude-opus-9"))
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    assert "'claude-opus-9' not found" in response.json()["error"]["message"]


# ---------------------------------------------------------------- auth and headers


def test_auth_by_x_api_key_or_bearer_and_query_strings() -> None:
    with LiveServer([ScriptedChatModel(["fine"])], api_keys=["sekret"]) as srv:
        beta = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}
        by_key = post(srv, body(), "/v1/messages?beta=true", {"x-api-key": "sekret", **beta})
        by_bearer = post(srv, body(), "/v1/messages?beta=true", {"authorization": "Bearer sekret"})
        old_version = post(srv, body(), headers={"x-api-key": "sekret", "anthropic-version": "2020-01-01"})
        missing = post(srv, body())
        wrong = post(srv, body(), headers={"x-api-key": "nope"})
        models_wrong = httpx.get(
            srv.url + "/v1/models", headers={"x-api-key": "no", "anthropic-version": "1"}
        )
        models_openai = httpx.get(srv.url + "/v1/models", headers={"authorization": "Bearer no"})
    assert by_key.status_code == by_bearer.status_code == old_version.status_code == 200
    assert by_key.json()["content"] == [{"type": "text", "text": "fine"}]
    for response in (missing, wrong, models_wrong):
        assert response.status_code == 401
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "authentication_error"
    # Without anthropic-version the shared route answers in OpenAI's envelope.
    assert models_openai.status_code == 401 and models_openai.json()["error"]["code"] == "invalid_api_key"


# ---------------------------------------------------------------- request shapes


def claude_code_body(attribution: str) -> dict[str, Any]:
    """The shape Claude Code sends (trimmed): attribution block, cache_control, beta fields."""
    return {
        "model": "scripted",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.197.{attribution}; cc_entrypoint=cli;",
            },
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be careful.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>context</system-reminder>"},
                    {"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "Available agent types: none."},
        ],
        "tools": [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}],
        "metadata": {"user_id": '{"device_id":"abc"}'},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "temperature": None,
        "container": None,
    }


def test_claude_code_shaped_request_and_attribution_dropped() -> None:
    backend = ScriptedChatModel(["done"])
    with LiveServer([backend]) as srv:
        headers = {"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07"}
        first = post(srv, claude_code_body("c40"), "/v1/messages?beta=true", headers)
        second = post(srv, claude_code_body("f1e"), "/v1/messages?beta=true", headers)
    assert first.status_code == second.status_code == 200
    assert [name for name, _ in sse(first.text)][-1] == "message_stop"
    text = prompt(backend, 0)
    assert "x-anthropic-billing-header" not in text
    # The attribution line changes per request; without it the prompts are identical, so a
    # prefix cache reuses all of it.
    assert backend.prompts[0] == backend.prompts[1]
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\nBe careful.\n\n# Tools")
    user_at = text.index("<system-reminder>context</system-reminder>\nlist files")
    assert text.index("<|im_start|>system\nAvailable agent types: none.<|im_end|>") > user_at


def test_system_messages_before_the_first_turn_join_the_system_prompt() -> None:
    backend = ScriptedChatModel(["ok"])
    with LiveServer([backend]) as srv:
        payload = body(
            system="Top.",
            messages=[
                {"role": "system", "content": [{"type": "text", "text": "Also this."}]},
                {"role": "user", "content": "hi"},
            ],
        )
        assert post(srv, payload).status_code == 200
    assert prompt(backend).startswith(
        "<|im_start|>system\nTop.\n\nAlso this.<|im_end|>\n<|im_start|>user\nhi"
    )


def test_tool_results_string_blocks_and_errors() -> None:
    backend = ScriptedChatModel(["Both done."])
    payload = body(
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "Checking.", "citations": None},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_2",
                        "content": [{"type": "text", "text": "station offline"}],
                        "is_error": True,
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "Summarize."},
                ],
            },
        ],
    )
    with LiveServer([backend]) as srv:
        response = post(srv, payload)
    assert response.status_code == 200 and response.json()["content"][0]["text"] == "Both done."
    text = prompt(backend)
    assert "<think>\nTwo cities.\n</think>\n\nChecking.\n<tool_call>" in text
    assert (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\nError: station offline\n</tool_response>"
        in text
    )
    assert text.endswith(
        "<|im_start|>user\nSummarize.<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )

    chat = parse_messages_request(payload)
    assert [(m.role, m.tool_call_id, m.name) for m in chat.messages if m.role == "tool"] == [
        ("tool", "toolu_1", "get_weather"),
        ("tool", "toolu_2", "get_weather"),
    ]


def test_images_are_decoded_and_refused_by_a_model_without_vision() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_1X1}}
    payload = body(messages=[{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}])
    (message,) = parse_messages_request(payload).messages
    assert message.content == "What is it?"
    assert message.images[0].media_type == "image/png" and message.images[0].data.startswith(b"\x89PNG")
    with LiveServer([ScriptedChatModel()]) as srv:
        for stream in (False, True):
            response = post(srv, {**payload, "stream": stream})
            assert_invalid(response, "cannot read images")


# ---------------------------------------------------------------- thinking


def effort_of(thinking: Any = None, effort: str | None = None) -> tuple[ReasoningEffort, int | None]:
    registry = ModelRegistry()
    registry.add(ScriptedChatModel())
    payload = body()
    if thinking is not None:
        payload["thinking"] = thinking
    if effort is not None:
        payload["output_config"] = {"effort": effort}
    plan = make_plan(parse_messages_request(payload), registry)
    return plan.reasoning, plan.thinking_budget


def test_thinking_maps_to_reasoning_effort() -> None:
    assert effort_of() == (ReasoningEffort.OFF, None)  # the scripted backend's default is off
    assert effort_of({"type": "disabled"}, "high") == (ReasoningEffort.OFF, None)
    assert effort_of({"type": "enabled", "budget_tokens": 1024}) == (ReasoningEffort.LOW, 1024)
    assert effort_of({"type": "enabled", "budget_tokens": 3000}) == (ReasoningEffort.MEDIUM, 3000)
    assert effort_of({"type": "enabled", "budget_tokens": 20000}) == (ReasoningEffort.HIGH, 20000)
    assert effort_of({"type": "enabled", "budget_tokens": 20000}, "low") == (ReasoningEffort.LOW, 20000)
    assert effort_of({"type": "adaptive"}) == (ReasoningEffort.MEDIUM, 2048)
    assert effort_of({"type": "adaptive"}, "max") == (ReasoningEffort.HIGH, 8192)
    assert effort_of(None, "low") == (ReasoningEffort.LOW, 512)


def test_thinking_switch_reaches_the_template_and_budget_is_enforced() -> None:
    reasoning = "abcdefghijklmnopqrstuvwxyz"
    backend = ScriptedChatModel([f"<think>{reasoning}</think>answer"] * 2)
    with LiveServer([backend]) as srv:
        off = post(srv, body(thinking={"type": "disabled"}))
        capped = post(srv, body(thinking={"type": "enabled", "budget_tokens": 5}))
    assert prompt(backend, 0).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert prompt(backend, 1).endswith("<|im_start|>assistant\n")
    assert off.json()["content"][0]["thinking"] == reasoning
    # The budget closes the think block after 5 reasoning tokens (one byte each here).
    assert capped.json()["content"][0] == {
        "type": "thinking",
        "thinking": reasoning[:5],
        "signature": capped.json()["content"][0]["signature"],
    }


def test_signature_is_stable_for_the_same_thinking() -> None:
    backend = ScriptedChatModel(["<think>same</think>a", "<think>same</think>b", "<think>other</think>c"])
    with LiveServer([backend]) as srv:
        sigs = [post(srv, body()).json()["content"][0]["signature"] for _ in range(3)]
    assert sigs[0] == sigs[1] != sigs[2]


# ---------------------------------------------------------------- stop reasons, prefill


def test_stop_sequence_and_max_tokens_stop_reasons() -> None:
    backend = ScriptedChatModel(["one two STOP three"])
    with LiveServer([backend]) as srv:
        stopped = post(srv, body(stop_sequences=["STOP", "never"])).json()
        streamed = sse(post(srv, body(stop_sequences=["STOP"], stream=True)).text)
        capped = post(srv, body(max_tokens=3)).json()
    assert stopped["content"] == [{"type": "text", "text": "one two "}]
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "STOP")
    delta = next(d for name, d in streamed if name == "message_delta")["delta"]
    assert delta == {"stop_reason": "stop_sequence", "stop_sequence": "STOP"}
    assert capped["content"] == [{"type": "text", "text": "one"}]
    assert (capped["stop_reason"], capped["stop_sequence"]) == ("max_tokens", None)
    assert capped["usage"]["output_tokens"] == 3


def test_assistant_prefill_is_continued() -> None:
    backend = ScriptedChatModel(['"Paris"}'])
    messages = [
        {"role": "user", "content": "Capital of France as JSON?"},
        {"role": "assistant", "content": '{"capital": '},
    ]
    with LiveServer([backend]) as srv:
        response = post(srv, body(messages=messages))
        with_thinking = post(srv, body(messages=messages, thinking={"type": "enabled", "budget_tokens": 10}))
    assert response.json()["content"] == [{"type": "text", "text": '"Paris"}'}]
    assert prompt(backend).endswith('<|im_start|>assistant\n<think>\n\n</think>\n\n{"capital": ')
    assert_invalid(with_thinking, "prefill")


# ---------------------------------------------------------------- streaming under load


class SlowScripted(ScriptedChatModel):
    """A scripted model whose prefill takes `delay` seconds (as a long prompt would), fed one
    prompt token per engine step so a cancel is seen between tokens."""

    def __init__(self, replies: Sequence[str], delay: float, **kwargs: Any) -> None:
        kwargs["scheduler"] = SchedulerConfig(
            max_batched_tokens=1, max_prefill_tokens=1, **kwargs.pop("scheduler", {})
        )
        super().__init__(replies, **kwargs)
        self.delay = delay
        self.started = threading.Event()
        self.cancelled = threading.Event()

    def seconds_per_prompt_token(self, num_prompt_tokens: int) -> float:
        return self.delay / num_prompt_tokens

    def run_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        self.started.set()
        result = super().run_completion(prompt_ids, config, images, cancel, on_progress)
        if result.finish_reason is FinishReason.CANCELLED and not result.token_ids:
            self.cancelled.set()
        return result


def served(backend: ScriptedChatModel, ping_interval: float = 10.0) -> LiveServer:
    registry = ModelRegistry()
    registry.add(backend)
    return LiveServer(state=ServerState(registry=registry, ping_interval=ping_interval))


def test_pings_while_a_long_prompt_is_processed() -> None:
    with served(SlowScripted(["late"], delay=0.8), ping_interval=0.1) as srv:
        events = sse(post(srv, body(stream=True)).text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    first_block = names.index("content_block_start")
    assert names[2:first_block].count("ping") >= 3
    assert names[first_block:] == [
        "content_block_start",
        *["content_block_delta"] * 4,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_pings_while_waiting_in_the_queue_then_overloaded_when_the_line_is_full() -> None:
    backend = SlowScripted(
        ["first", "second"], delay=1.0, scheduler={"max_active": 1, "max_waiting": 1, "retry_after": 2.0}
    )
    with served(backend, ping_interval=0.1) as srv:
        results: dict[str, httpx.Response] = {}
        holder = threading.Thread(target=lambda: results.update(first=post(srv, body())))
        holder.start()
        assert backend.started.wait(10)
        waiter = threading.Thread(target=lambda: results.update(second=post(srv, body(stream=True))))
        waiter.start()
        deadline = time.monotonic() + 10
        line = backend.engine.scheduler
        # the first request holds the only running slot, the second waits in line
        while (line.num_running, line.num_waiting) != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = post(srv, body())
        holder.join(20)
        waiter.join(20)
    assert refused.status_code == 529
    assert refused.headers["retry-after"] == "2"
    assert refused.json()["error"]["type"] == "overloaded_error"
    assert results["first"].json()["content"][0]["text"] == "first"
    names = [name for name, _ in sse(results["second"].text)]
    assert names[:2] == ["message_start", "ping"]
    assert names[2 : names.index("content_block_start")].count("ping") >= 3
    assert names[-1] == "message_stop"


def test_client_disconnect_during_prefill_cancels_the_generation() -> None:
    backend = SlowScripted(["never sent"], delay=30.0, scheduler={"max_active": 1})
    with served(backend, ping_interval=0.1) as srv:
        with httpx.stream(
            "POST", srv.url + "/v1/messages", json=body(stream=True), headers={"anthropic-version": "1"}
        ) as response:
            lines = response.iter_lines()
            assert next(lines) == "event: message_start"
            assert backend.started.wait(10)
        assert backend.cancelled.wait(10)
        scheduler = backend.engine.scheduler
        deadline = time.monotonic() + 10
        while scheduler.num_running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert scheduler.num_running == 0  # the slot came back
        assert scheduler.blocks.num_used_blocks == 0  # and its KV blocks


def test_client_disconnect_while_queued_leaves_the_line() -> None:
    backend = SlowScripted(["never sent"], delay=30.0, scheduler={"max_active": 1, "max_waiting": 4})
    queue = backend.engine.scheduler

    def wait_for(condition: Any) -> None:
        deadline = time.monotonic() + 10
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert condition()

    with served(backend, ping_interval=0.1) as srv:
        request = {"json": body(stream=True), "headers": {"anthropic-version": "1"}}
        # Iterators are kept referenced: a dropped one closes its response (a disconnect).
        with httpx.stream("POST", srv.url + "/v1/messages", **request) as holder:
            holder_lines = holder.iter_lines()
            assert next(holder_lines) == "event: message_start"
            with httpx.stream("POST", srv.url + "/v1/messages", **request) as waiter:
                waiter_lines = waiter.iter_lines()
                assert next(waiter_lines) == "event: message_start"  # pinged while in line
                assert queue.num_waiting == 1
            wait_for(lambda: queue.num_waiting == 0)
            assert queue.num_running == 1
        wait_for(lambda: queue.num_running == 0)


class FailsMidStream(ScriptedChatModel):
    def run_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        num_seen = 0

        def progress(token: TokenEvent) -> None:
            nonlocal num_seen
            num_seen += 1
            if num_seen > 3:
                raise RuntimeError("device lost")
            on_progress(token)

        return super().run_completion(prompt_ids, config, images, cancel, progress)


def test_failure_after_the_stream_started_is_an_error_event() -> None:
    with served(FailsMidStream(["abcdefgh"])) as srv:
        response = post(srv, body(stream=True))
    assert response.status_code == 200
    events = sse(response.text)
    assert [name for name, _ in events][:3] == ["message_start", "ping", "content_block_start"]
    name, data = events[-1]
    assert name == "error"
    assert data["error"]["type"] == "api_error" and "device lost" in data["error"]["message"]
    assert "message_stop" not in [n for n, _ in events]
