"""The OpenAI Responses API, driven by the openai SDK (`responses.create` / `responses.stream`)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import openai
import pytest

from turbospark.api.responses import parse_input, parse_request
from turbospark.backend import (
    CancelFlag,
    CompletionResult,
    GenerationConfig,
    ProgressCallback,
    ReasoningEffort,
    RequestImage,
)
from turbospark.errors import ApiError
from turbospark.plan import make_plan
from turbospark.ratecontrol import RateControl
from turbospark.registry import ModelRegistry
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}
THOUGHTFUL = "<think>The user wants a greeting.</think>Hello there!"


def serve(*replies: str) -> tuple[LiveServer, ScriptedChatModel]:
    backend = ScriptedChatModel(list(replies))
    return LiveServer([backend]), backend


def client_for(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def prompt_text(backend: ScriptedChatModel, index: int = -1) -> str:
    return backend.tokenizer.decode(backend.prompts[index], skip_special_tokens=False)


@pytest.fixture
def thoughtful() -> Iterator[tuple[openai.OpenAI, ScriptedChatModel]]:
    server, backend = serve(THOUGHTFUL)
    with server, client_for(server) as client:
        yield client, backend


def test_create_returns_reasoning_and_message(thoughtful: tuple[openai.OpenAI, ScriptedChatModel]) -> None:
    client, backend = thoughtful
    response = client.responses.create(model="scripted", input="Say hello")
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.model == "scripted"
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content is not None and reasoning.content[0].text == "The user wants a greeting."
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.output_text == "Hello there!"
    usage = response.usage
    assert usage is not None
    assert usage.input_tokens == len(backend.prompts[0])
    assert usage.output_tokens == len(backend.tokenizer.encode(THOUGHTFUL))
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens > 0


def test_stream_event_sequence(thoughtful: tuple[openai.OpenAI, ScriptedChatModel]) -> None:
    client, _ = thoughtful
    events = list(client.responses.create(model="scripted", input="Say hello", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    # Runs of deltas collapse to one entry, so the order of everything else is exact.
    collapsed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1] or not k.endswith(".delta")]
    assert collapsed == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0].response.status == "in_progress"  # type: ignore[union-attr]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello there!"
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1  # type: ignore[attr-defined]


def test_responses_stream_and_non_streaming_agree() -> None:
    server, _ = serve(THOUGHTFUL)
    with server, client_for(server) as client:
        whole = client.responses.create(model="scripted", input="Say hello")
        with client.responses.stream(model="scripted", input="Say hello") as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == whole.output_text == "Hello there!"

    def shape(value: Any) -> Any:
        # Ids differ per response; responses.stream adds its parsed_* fields.
        if isinstance(value, dict):
            return {k: shape(v) for k, v in value.items() if k != "id" and not k.startswith("parsed")}
        if isinstance(value, list):
            return [shape(v) for v in value]
        return value

    assert final.output and len(final.output) == len(whole.output)

    assert shape([i.model_dump() for i in final.output]) == shape([i.model_dump() for i in whole.output])


def test_async_client_streams() -> None:
    server, _ = serve("Bonjour!")

    async def run(url: str) -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            whole = await client.responses.create(model="scripted", input="hi")
            stream = await client.responses.create(model="scripted", input="hi", stream=True)
            text = "".join([e.delta async for e in stream if e.type == "response.output_text.delta"])
            return whole.output_text, text

    with server:
        assert asyncio.run(run(server.url)) == ("Bonjour!", "Bonjour!")


def test_function_call_round_trip() -> None:
    server, backend = serve(WEATHER_CALL, "It is 18 degrees in Paris.")
    with server, client_for(server) as client:
        first = client.responses.create(
            model="scripted", input="Weather in Paris?", tools=[WEATHER_TOOL], instructions="Use tools."
        )
        (call,) = first.output
        assert call.type == "function_call" and call.status == "completed"
        assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
        assert call.call_id.startswith("call_") and call.id is not None and call.id.startswith("fc_")
        assert first.output_text == ""
        assert prompt_text(backend, 0).startswith("<|im_start|>system\nUse tools.\n\n# Tools")

        second = client.responses.create(
            model="scripted",
            instructions="Use tools.",
            tools=[WEATHER_TOOL],
            input=[
                {"role": "user", "content": "Weather in Paris?"},
                *[item.model_dump(exclude_none=True) for item in first.output],  # type: ignore[misc]
                {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"},
            ],
        )
        assert second.output_text == "It is 18 degrees in Paris."
        prompt = prompt_text(backend, 1)
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
        assert "<tool_response>\n18 degrees\n</tool_response>" in prompt


def test_streamed_function_call_events() -> None:
    server, _ = serve(WEATHER_CALL)
    with (
        server,
        client_for(server) as client,
        client.responses.stream(model="scripted", input="Weather?", tools=[WEATHER_TOOL]) as stream,
    ):
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added"
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}
    (call,) = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert kinds[-1] == "response.completed"


def test_reasoning_effort_and_summary() -> None:
    server, backend = serve(THOUGHTFUL)
    with server, client_for(server) as client:
        client.responses.create(model="scripted", input="hi", reasoning={"effort": "none"})
        assert prompt_text(backend, 0).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        summarized = client.responses.create(
            model="scripted", input="hi", reasoning={"effort": "high", "summary": "auto"}
        )
        assert prompt_text(backend, 1).endswith("<|im_start|>assistant\n")
        reasoning = summarized.output[0]
        assert reasoning.type == "reasoning"
        assert [s.text for s in reasoning.summary] == ["The user wants a greeting."]
        assert summarized.reasoning is not None and summarized.reasoning.effort == "high"
        kinds = [
            e.type
            for e in client.responses.create(
                model="scripted", input="hi", reasoning={"effort": "low", "summary": "concise"}, stream=True
            )
        ]
        assert "response.reasoning_summary_text.delta" in kinds
        assert kinds.index("response.reasoning_summary_part.done") < kinds.index("response.output_item.done")


def test_max_output_tokens_is_incomplete() -> None:
    server, _ = serve("A rather long answer")
    with server, client_for(server) as client:
        cut = client.responses.create(model="scripted", input="hi", max_output_tokens=6)
        assert cut.status == "incomplete"
        assert cut.incomplete_details is not None and cut.incomplete_details.reason == "max_output_tokens"
        assert cut.output_text == "A rath" and cut.output[0].status == "incomplete"
        events = list(client.responses.create(model="scripted", input="hi", max_output_tokens=6, stream=True))
        assert events[-1].type == "response.incomplete"
        assert events[-1].response.output[0].status == "incomplete"  # type: ignore[union-attr]


def test_sampling_and_format_fields_are_accepted() -> None:
    server, _ = serve('{"city": "Paris"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    with server, client_for(server) as client:
        response = client.responses.create(
            model="scripted",
            input=[{"role": "developer", "content": "Reply in JSON."}, {"role": "user", "content": "City?"}],
            temperature=0.3,
            top_p=0.9,
            store=True,
            metadata={"run": "1"},
            text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
            tool_choice="none",
            tools=[WEATHER_TOOL],
            parallel_tool_calls=False,
        )
    assert response.output_text == '{"city": "Paris"}'
    assert response.temperature == 0.3 and response.top_p == 0.9
    assert response.text is not None and response.text.format.type == "json_schema"
    assert response.parallel_tool_calls is False and response.tool_choice == "none"


def test_logprobs_when_asked() -> None:
    server, _ = serve("ab")
    with server, client_for(server) as client:
        response = client.responses.create(model="scripted", input="hi", top_logprobs=2)
    message = response.output[0]
    assert message.type == "message"
    content = message.content[0]
    assert content.type == "output_text" and content.logprobs is not None
    assert [lp.token for lp in content.logprobs] == ["a", "b"]
    assert all(len(lp.top_logprobs) == 2 for lp in content.logprobs)


def test_errors() -> None:
    server, _ = serve("ok")
    with server, client_for(server) as client:
        with pytest.raises(openai.BadRequestError, match="stores nothing"):
            client.responses.create(model="scripted", input="hi", previous_response_id="resp_123")
        with pytest.raises(openai.NotFoundError, match="no-such-model"):
            client.responses.create(model="no-such-model", input="hi")
        with pytest.raises(openai.BadRequestError, match="matches no function_call"):
            client.responses.create(
                model="scripted", input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}]
            )
        picture = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 16).decode()
        with pytest.raises(openai.BadRequestError, match="image"):
            client.responses.create(
                model="scripted",
                input=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_text", "text": "What is this?"},
                            {"type": "input_image", "image_url": picture, "detail": "auto"},
                        ],
                    }
                ],
            )
        with pytest.raises(openai.NotFoundError, match="stores no responses"):
            client.responses.retrieve("resp_123")
        with pytest.raises(openai.BadRequestError, match="background"):
            client.responses.create(model="scripted", input="hi", background=True)
    with LiveServer([ScriptedChatModel(["ok"])], api_keys=["k"]) as guarded:
        reply = httpx.post(guarded.url + "/v1/responses", json={"model": "scripted", "input": "hi"})
        assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"


class _FailsMidway(ScriptedChatModel):
    def run_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        seen = 0

        def progress(token: Any) -> None:
            nonlocal seen
            seen += 1
            if seen > 3:
                raise RuntimeError("device lost")
            on_progress(token)

        return super().run_completion(prompt_ids, config, images, cancel, progress)


def test_failure_mid_stream_is_error_then_failed() -> None:
    with LiveServer([_FailsMidway(["a long enough reply"])]) as server, client_for(server) as client:
        events = list(client.responses.create(model="scripted", input="hi", stream=True))
    assert events[-2].type == "error" and "device lost" in events[-2].message
    assert events[-1].type == "response.failed"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error is not None and "device lost" in failed.error.message


def test_input_items_group_into_turns() -> None:
    messages = parse_input(
        [
            {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris and Lyon?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Two."}],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "get_weather",
                "arguments": '{"city": "Lyon"}',
            },
            {"type": "function_call_output", "call_id": "c2", "output": "15C"},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_text", "text": "18C"}],
            },
        ],
        "Be brief.",
    )
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "tool"]
    turn = messages[2]
    assert (turn.reasoning, turn.content) == ("Two.", "Checking.")
    assert [(c.id, c.name) for c in turn.tool_calls] == [("c1", "get_weather"), ("c2", "get_weather")]
    assert [(m.tool_call_id, m.name, m.content) for m in messages[3:]] == [
        ("c2", "get_weather", "15C"),
        ("c1", "get_weather", "18C"),
    ]


def test_request_fields_map() -> None:
    request = parse_request(
        {
            "model": "m",
            "input": "hi",
            "reasoning": {"effort": "minimal"},
            "max_output_tokens": 50,
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_object"}},
        }
    )
    assert request.reasoning_effort is ReasoningEffort.LOW
    assert request.max_tokens == 50
    assert request.tool_choice.name == "get_weather"
    assert request.response_format is not None and request.response_format.type == "json_object"
    with pytest.raises(ApiError, match="tool_choice"):
        # The tool_choice policy is the plan's: checked before the model is even looked up.
        make_plan(
            parse_request({"model": "m", "input": "hi", "tool_choice": {"type": "function", "name": "nope"}}),
            ModelRegistry(),
        )
    with pytest.raises(ApiError, match="input"):
        parse_request({"model": "m", "input": 3})


def test_stream_disconnect_stops_generation() -> None:
    control = RateControl(200)
    backend = ScriptedChatModel(["z" * 2000], rate=control)
    with LiveServer([backend]) as server, client_for(server) as client:
        stream = client.responses.create(model="scripted", input="hi", stream=True)
        events = iter(stream)
        for _ in range(8):
            next(events)
        stream.close()
        time.sleep(0.5)
        made = control.num_tokens
        time.sleep(0.5)
        assert control.num_tokens == made < 300


NAMESPACE_TOOL: Any = {
    "type": "namespace",
    "name": "agents",
    "description": "Helpers",
    "tools": [{**WEATHER_TOOL, "name": "close_agent"}, {**WEATHER_TOOL, "name": "wait_agent"}],
}
PATCH_TOOL: Any = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files",
    "format": {"type": "grammar", "syntax": "lark", "definition": 'start: "*** Begin Patch" /.+/'},
}
HOSTED_TOOLS: Any = [
    {"type": "web_search", "external_web_access": False},
    {"type": "local_shell"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "image_generation"},
]


def test_tool_kinds_an_agent_sends() -> None:
    """Namespaces are flattened, custom tools become functions of one string, and hosted tools
    are left out (never a 400); calls go back in the shape each tool was declared in."""
    namespaced = '<tool_call>\n{"name": "agents__close_agent", "arguments": {"city": "x"}}\n</tool_call>'
    patch = (
        '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\nend"}}\n</tool_call>'
    )
    server, backend = serve(namespaced, patch, patch, "done")
    tools = [WEATHER_TOOL, NAMESPACE_TOOL, PATCH_TOOL, *HOSTED_TOOLS]
    with server, client_for(server) as client:
        first = client.responses.create(model="scripted", input="Close it.", tools=tools)
        (call,) = first.output
        assert call.type == "function_call" and call.name == "close_agent"
        assert call.model_dump()["namespace"] == "agents"
        prompt = prompt_text(backend, 0)
        for name in ("get_weather", "agents__close_agent", "agents__wait_agent", "apply_patch"):
            assert f'"name": "{name}"' in prompt
        for hosted in ("web_search", "local_shell", "file_search", "image_generation"):
            assert hosted not in prompt
        assert '*** Begin Patch\\" /.+/' in prompt  # the custom tool's grammar, for the model to follow

        second = client.responses.create(model="scripted", input="Patch it.", tools=tools)
        (custom,) = second.output
        assert custom.type == "custom_tool_call" and custom.name == "apply_patch"
        assert custom.input == "*** Begin Patch\nend" and custom.call_id.startswith("call_")

        with client.responses.stream(model="scripted", input="Patch it.", tools=tools) as stream:
            events = list(stream)
        kinds = [e.type for e in events]
        assert kinds.index("response.output_item.added") < kinds.index("response.custom_tool_call_input.done")
        assert kinds.index("response.custom_tool_call_input.done") < kinds.index("response.output_item.done")
        done = next(e for e in events if e.type == "response.output_item.done")
        assert done.item.type == "custom_tool_call" and done.item.input == "*** Begin Patch\nend"

        # The history comes back with the namespaced call split, the custom call's input, and
        # what hosted tools did elsewhere (left out).
        third = client.responses.create(
            model="scripted",
            tools=tools,
            input=[
                {"role": "user", "content": "Close it, then patch."},
                {
                    "type": "web_search_call",
                    "id": "ws_1",
                    "status": "completed",
                    "action": {"type": "search"},
                },
                call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": "closed"},
                custom.model_dump(exclude_none=True),
                {"type": "custom_tool_call_output", "call_id": custom.call_id, "output": "patched"},
            ],
        )
        assert third.output_text == "done"
        history = prompt_text(backend, 3)
        assert '{"name": "agents__close_agent", "arguments": {"city": "x"}}' in history
        assert '{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\nend"}}' in history
        assert "<tool_response>\nclosed\n</tool_response>" in history
        assert "<tool_response>\npatched\n</tool_response>" in history

        forced = client.responses.create(
            model="scripted",
            input="x",
            tools=tools,
            tool_choice={"type": "custom", "name": "apply_patch"},  # type: ignore[arg-type,misc]
        )
        assert forced.status == "completed"
        with pytest.raises(openai.BadRequestError, match="declared twice"):
            client.responses.create(model="scripted", input="x", tools=[WEATHER_TOOL, WEATHER_TOOL])
        # a tool must say its kind (only a namespace's own functions may leave it out)
        untyped = {"name": "get_weather", "parameters": {"type": "object"}}
        with pytest.raises(openai.BadRequestError, match=r"'tools\[1\]\.type' is required"):
            client.responses.create(model="scripted", input="x", tools=[WEATHER_TOOL, untyped])  # type: ignore[list-item]
