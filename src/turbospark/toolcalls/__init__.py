"""Tool-call parsing: generated answer text in, text and tool-call events out.

`make_tool_parser` picks a parser for the model family from its chat template. A parser is fed
the answer channel (after reasoning was split off) as it streams and yields `TextDelta`,
`ToolCallStart` and `ToolCallArgs` events; `finish` flushes what is held back. A call that cannot
be parsed comes back as text, never dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from turbospark.backend import GuardrailConfig
from turbospark.events import TextDelta, ToolCallArgs, ToolCallStart
from turbospark.request import Tool

ToolEvent = TextDelta | ToolCallStart | ToolCallArgs


class ToolParser(Protocol):
    num_calls: int

    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...


def make_tool_parser(
    chat_template: str | None, tools: Sequence[Tool], guardrails: GuardrailConfig
) -> ToolParser | None:
    """None when the request carries no tools: then the answer is plain text."""
    if not tools:
        return None
    from turbospark.toolcalls.hermes import HermesParser

    return HermesParser(tools, guardrails)
