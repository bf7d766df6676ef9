"""Tool-call parsing: generated answer text in, text and tool-call events out.

`make_tool_parser` picks a parser for the model family from its chat template. A parser is fed
the answer channel (after reasoning was split off) as it streams and yields `TextDelta`,
`ToolCallStart` and `ToolCallArgs` events; `finish` flushes what is held back. A call is emitted
whole once it is complete and has passed the guardrails (`turbospark.toolcalls.guardrails`), so streaming
and non-streaming yield the same calls. A call that cannot be parsed or repaired comes back as
text, never dropped, and is counted in `/metrics`.

Families: Hermes / Qwen2.5 (`<tool_call>{json}</tool_call>`), Qwen3-coder (`<function=...>`
XML), Llama 3 (bare JSON, `<|python_tag|>`) and Mistral (`[TOOL_CALLS]`).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum
from typing import Protocol

from turbospark.request import Tool
from turbospark.toolcalls.guardrails import GuardrailConfig
from turbospark.toolcalls.stream import CallStats, StreamToolParser, ToolEvent

__all__ = ["CallStats", "ToolEvent", "ToolFamily", "ToolParser", "detect_family", "make_tool_parser"]


class ToolParser(Protocol):
    num_calls: int
    special_markers: tuple[str, ...]  # special tokens the detokenizer must keep as text

    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...


class ToolFamily(StrEnum):
    HERMES = "hermes"
    QWEN3_CODER = "qwen3_coder"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


def detect_family(chat_template: str | None) -> ToolFamily:
    """The call syntax a chat template teaches its model. Hermes when nothing else is seen."""
    t = chat_template or ""
    if "[TOOL_CALLS]" in t:
        return ToolFamily.MISTRAL
    if "<function=" in t and "<parameter=" in t:
        return ToolFamily.QWEN3_CODER
    if "<tool_call>" in t:
        return ToolFamily.HERMES
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return ToolFamily.LLAMA3
    return ToolFamily.HERMES


def parser_class(family: ToolFamily) -> type[StreamToolParser]:
    if family is ToolFamily.QWEN3_CODER:
        from turbospark.toolcalls.qwen3_coder import Qwen3CoderParser

        return Qwen3CoderParser
    if family is ToolFamily.LLAMA3:
        from turbospark.toolcalls.llama3 import Llama3Parser

        return Llama3Parser
    if family is ToolFamily.MISTRAL:
        from turbospark.toolcalls.mistral import MistralParser

        return MistralParser
    from turbospark.toolcalls.hermes import HermesParser

    return HermesParser


def make_tool_parser(
    chat_template: str | None, tools: Sequence[Tool], guardrails: GuardrailConfig
) -> StreamToolParser | None:
    """None when the request carries no tools: then the answer is plain text."""
    if not tools:
        return None
    return parser_class(detect_family(chat_template))(tools, guardrails)
