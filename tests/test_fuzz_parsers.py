"""Property-based tests of what reads untrusted input: the body parsers and the tool-call parsers.

Body parsers take any JSON object and either build a request or raise an `ApiError` with a 4xx
status; nothing else may escape. Tool-call parsers take any model output, split into any chunks,
and never raise; text that is not a call comes back as text.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbospark.api import anthropic, fields, ollama, openai, responses
from turbospark.errors import ApiError
from turbospark.events import TextDelta, ToolCallArgs, ToolCallStart
from turbospark.request import Tool
from turbospark.toolcalls import ToolFamily, parser_class
from turbospark.toolcalls.guardrails import GuardrailConfig

SETTINGS = settings(
    max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=8,
)
KEYS = [
    "model", "messages", "input", "prompt", "system", "instructions", "tools", "tool_choice", "stream",
    "stream_options", "max_tokens", "max_completion_tokens", "max_output_tokens", "n", "stop",
    "stop_sequences", "temperature", "top_p", "top_k", "seed", "logprobs", "top_logprobs", "logit_bias",
    "response_format", "reasoning_effort", "reasoning", "thinking", "output_config", "format", "think",
    "options", "keep_alive", "images", "raw", "text", "metadata", "role", "content", "type",
]  # fmt: skip
# Bodies with the fields the parsers look at (and plausible shapes for messages), plus noise.
message = st.dictionaries(
    st.sampled_from(["role", "content", "tool_calls", "tool_call_id", "name", "images", "type"]),
    st.sampled_from(["user", "assistant", "system", "tool"]) | json_values,
    max_size=4,
)
bodies = st.builds(
    lambda base, extra: {**extra, **base},
    st.fixed_dictionaries(
        {"model": st.sampled_from(["scripted", ""]) | json_values, "messages": st.lists(message, max_size=3)}
    ),
    st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6),
)

PARSERS = {
    "openai chat": openai.parse_chat_request,
    "anthropic messages": anthropic.parse_messages_request,
    "ollama chat": ollama.parse_chat_request,
    "ollama generate": ollama.parse_generate_request,
    "responses": responses.parse_request,
}


@pytest.mark.parametrize("parse", PARSERS.values(), ids=PARSERS.keys())
def test_body_parsers_accept_or_refuse_with_a_4xx(parse: Any) -> None:
    @SETTINGS
    @given(body=bodies)
    def check(body: dict[str, Any]) -> None:
        try:
            parse(body)
        except ApiError as exc:
            assert 400 <= exc.status < 500 and exc.message

    check()


@SETTINGS
@given(body=st.dictionaries(st.text(max_size=5), json_values, max_size=5), key=st.text(max_size=5))
def test_field_readers_return_their_type_or_a_400(body: dict[str, Any], key: str) -> None:
    readers = [
        lambda: fields.string(body, key),
        lambda: fields.boolean(body, key, False),
        lambda: fields.integer(body, key, minimum=0, maximum=10),
        lambda: fields.number(body, key, minimum=0.0, maximum=2.0),
        lambda: fields.array(body, key),
        lambda: fields.obj(body, key),
        lambda: fields.stop_list(body, key),
    ]
    for read in readers:
        try:
            read()
        except ApiError as exc:
            assert exc.status == 400 and exc.param == key


@SETTINGS
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_json_body_reader(raw: bytes) -> None:
    try:
        assert isinstance(fields.parse_json_object(raw), dict)
    except ApiError as exc:
        assert exc.status == 400


@SETTINGS
@given(data=st.text(max_size=100))
def test_image_reader_never_fetches_and_refuses_cleanly(data: str) -> None:
    try:
        image = fields.decode_base64_image(data, "image")
    except ApiError as exc:
        assert 400 <= exc.status < 500
    else:
        assert image.data


TOOLS = [
    Tool("get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}}),
    Tool("run", parameters={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
]
MARKUP = [
    "<tool_call>", "</tool_call>", "<function=get_weather>", "</function>", "<parameter=city>",
    "</parameter>", "<|python_tag|>", "[TOOL_CALLS]", '{"name": "get_weather", "arguments": {"city": "x"}}',
    '{"name": "run", "parameters": {"n": 1}}', "{", "}", '"', ",", "[", "]", "\n", " ", "ok", "é",
]  # fmt: skip
outputs = st.lists(st.sampled_from(MARKUP) | st.text(max_size=8), max_size=30).map("".join)


@pytest.mark.parametrize("family", list(ToolFamily))
def test_tool_call_parsers_never_raise_and_lose_no_text(family: ToolFamily) -> None:
    @SETTINGS
    @given(text=outputs, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10))
    def check(text: str, cuts: list[int]) -> None:
        parser = parser_class(family)(TOOLS, GuardrailConfig())
        points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
        events = []
        for start, end in itertools.pairwise(points):
            events += parser.feed(text[start:end])
        events += parser.finish()
        names = {t.name for t in TOOLS}
        args: dict[int, str] = {}
        for event in events:
            if isinstance(event, ToolCallStart):
                assert event.name in names
                args[event.index] = ""
            elif isinstance(event, ToolCallArgs):
                args[event.index] += event.delta
            else:
                assert isinstance(event, TextDelta)
        for text_args in args.values():
            assert isinstance(json.loads(text_args), dict)  # every emitted call has object arguments

    check()
