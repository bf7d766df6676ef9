"""Our Jinja rendering equals transformers' apply_chat_template on real published templates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from turbospark.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat_template

TEMPLATES = Path(__file__).parent / "templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}

CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "single": [{"role": "user", "content": "Hello there"}],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour. Ünïcødé ✓ 日本"},
    ],
    "multi_turn": [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "  Tell me a joke  "},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
    ],
}

# (template file, conversations it supports, whether it takes tools)
CASES = [
    ("smollm2.jinja", ["single", "system", "multi_turn"], False),
    ("qwen2.5.jinja", list(CONVERSATIONS), True),
    ("llama3.2.jinja", list(CONVERSATIONS), True),
]

SPECIAL = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}


def reference(
    template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, **kw: Any
) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools,
        chat_template=template,
        add_generation_prompt=True,
        **SPECIAL,
        **kw,
    )
    return str(rendered[0])


@pytest.mark.parametrize(("name", "convs", "with_tools"), CASES)
def test_matches_transformers(name: str, convs: list[str], with_tools: bool) -> None:
    template = (TEMPLATES / name).read_text(encoding="utf-8")
    for conv in convs:
        for tools in [None, [WEATHER]] if with_tools else [None]:
            if conv == "tool_round_trip" and tools is None:
                continue
            messages = CONVERSATIONS[conv]
            ours = render_chat_template(
                template, messages, tools=tools, add_generation_prompt=True, **SPECIAL
            )
            assert ours == reference(template, messages, tools), f"{name} / {conv} / tools={bool(tools)}"


@pytest.mark.parametrize("thinking", [True, False])
def test_builtin_chatml_matches_transformers(thinking: bool) -> None:
    for conv, messages in CONVERSATIONS.items():
        tools = [WEATHER] if conv == "tool_round_trip" else None
        ours = render_chat_template(
            CHATML_TEMPLATE,
            messages,
            tools=tools,
            add_generation_prompt=True,
            enable_thinking=thinking,
            **SPECIAL,
        )
        assert ours == reference(CHATML_TEMPLATE, messages, tools, enable_thinking=thinking)


def test_reasoning_history_is_visible_under_both_names() -> None:
    template = "{% for m in messages %}[{{ m.reasoning_content }}|{{ m.thinking }}]{% endfor %}"
    out = render_chat_template(template, [{"role": "assistant", "content": "x", "reasoning_content": "r"}])
    assert out == "[r|r]"


def test_raise_exception_is_a_template_error() -> None:
    template = (TEMPLATES / "llama3.2.jinja").read_text(encoding="utf-8")
    two_calls = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "tool_calls": [
                {"type": "function", "function": {"name": "a", "arguments": {}}},
                {"type": "function", "function": {"name": "b", "arguments": {}}},
            ],
        },
    ]
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        render_chat_template(template, two_calls, tools=[WEATHER])


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__name__ }}",
        "{% set ns = namespace(_x=1) %}",
        "{{ messages.append(1) }}",
    ],
)
def test_sandbox_refuses_escapes(source: str) -> None:
    with pytest.raises(ChatTemplateError, match=r"unsafe|underscore|not safely|access"):
        render_chat_template(source, [{"role": "user", "content": "x"}])


def test_unsafe_attribute_renders_nothing() -> None:
    assert render_chat_template("{{ messages.__class__ }}", [{"role": "user", "content": "x"}]) == ""
