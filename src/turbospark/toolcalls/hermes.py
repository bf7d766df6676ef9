"""Hermes / Qwen2.5 style calls: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

Each call sits in its own tag pair; several calls are several pairs. Besides the tags, the
guardrails accept what small Qwen models write instead: a list of calls in one pair, a call
whose closing tag never came (the next `<tool_call>` or the end of the output closes it), and a
bare or code-fenced JSON call at the start of the answer, maybe after a short junk prefix such as
`>` (`stream.junk_prefix_end`), and a code-fenced call to a declared tool after text ("Here's how
you can do it:" and the call: qwen2.5-coder:1.5b under Claude Code, benchmarks/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Sequence

from turbospark.request import Tool
from turbospark.toolcalls.guardrails import GuardrailConfig
from turbospark.toolcalls.stream import (
    RawCall,
    Scan,
    StreamToolParser,
    bare_region_end,
    calls_from_json,
    parse_bare,
    parse_json_body,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesParser(StreamToolParser):
    markers = (OPEN,)

    def __init__(self, tools: Sequence[Tool], guardrails: GuardrailConfig) -> None:
        super().__init__(tools, guardrails)
        self.bare_json = guardrails.enabled
        self.fenced_after_text = guardrails.enabled

    def region_end(self, marker: str, text: str) -> int | Scan:
        if marker == "":
            return bare_region_end(text, self.json_end)
        close = text.find(CLOSE)
        reopen = text.find(OPEN)
        if reopen >= 0 and (close < 0 or reopen < close):
            return reopen  # an unclosed call followed by the next one
        return Scan.MORE if close < 0 else close + len(CLOSE)

    def parse_region(self, marker: str, region: str, complete: bool) -> list[RawCall] | None:
        if marker == "":
            return parse_bare(region, self.config)
        repairs: list[str] = []
        body = region
        if body.endswith(CLOSE):
            body = body[: -len(CLOSE)]
        elif complete:
            repairs.append("unclosed")  # closed by the next <tool_call>
        body = body.strip()
        if body.startswith("```"):
            return [
                RawCall(c.name, c.arguments, marker + region, c.repairs + repairs)
                for c in parse_bare(body, self.config) or []
            ] or None
        value = parse_json_body(body, self.config, repairs)
        return calls_from_json(value, marker + region, repairs)
