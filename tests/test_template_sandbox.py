"""Chat templates are data from a checkpoint: hostile ones fail cleanly and in bounded time."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbospark.chat_template import CHATML_TEMPLATE, ChatTemplateError, render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]

HOSTILE = {
    "attribute tricks": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals through a method": "{{ messages.append.__globals__ }}",
    "format string escape": "{{ '{0.__class__.__init__.__globals__}'.format(messages) }}",
    "namespace underscore": "{% set ns = namespace(_x=1) %}{{ ns }}",
    "mutating the messages": "{{ messages.append(1) }}",
    "nested loops forever": "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "huge string": "{{ 'x' * 1000000000 }}",
    "huge power": "{{ 10 ** 100000000 }}",
    "output flood": "{% for a in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
    "reading a file": "{% include '/etc/passwd' %}",
    "importing": "{% import 'os' as os %}",
}


@pytest.mark.parametrize("source", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_templates_fail_cleanly(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        render_chat_template(source, MESSAGES)


content = st.text(max_size=200)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]), "content": content},
    optional={
        "tool_calls": st.lists(
            st.fixed_dictionaries(
                {
                    "id": st.text(max_size=10),
                    "type": st.just("function"),
                    "function": st.fixed_dictionaries(
                        {
                            "name": st.text(max_size=20),
                            "arguments": st.one_of(
                                st.text(max_size=50), st.dictionaries(st.text(max_size=5), st.integers())
                            ),
                        }
                    ),
                }
            ),
            max_size=3,
        ),
        "reasoning_content": content,
    },
)
tools = st.none() | st.lists(
    st.fixed_dictionaries(
        {
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": st.text(max_size=20), "parameters": st.just({"type": "object"})}
            ),
        }
    ),
    max_size=3,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages=st.lists(message, min_size=1, max_size=6), tools=tools, thinking=st.booleans())
def test_any_messages_render_or_fail_as_template_errors(messages, tools, thinking) -> None:
    try:
        text = render_chat_template(CHATML_TEMPLATE, messages, tools=tools, enable_thinking=thinking)
    except ChatTemplateError:
        return
    assert text.endswith("<|im_start|>assistant\n") or text.endswith("</think>\n\n")
