"""Qwen3-coder XML calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are raw text; a value is read as JSON unless the tool's schema says it is a
string, so `3` is a number and `{"a": 1}` an object. Repairs: a missing `</parameter>` (the next
parameter or `</function>` ends it), a missing `</function>` or `</tool_call>`, a `<function=`
block without the `<tool_call>` wrapper, and a Hermes JSON body inside the wrapper.
"""

from __future__ import annotations

import json
import re
from typing import Any

from turbospark.toolcalls.guardrails import JsonRepairError, loads_tolerant
from turbospark.toolcalls.stream import (
    RawCall,
    Scan,
    StreamToolParser,
    calls_from_json,
    parse_json_body,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
_FUNCTION = re.compile(r"<function=([^>\n]*)>?(.*?)(?:</function>|(?=<function=)|$)", re.DOTALL)
_PARAM = re.compile(
    r"<parameter=([^>\n]*)>?\n?(.*?)(?:\n?</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL
)


class Qwen3CoderParser(StreamToolParser):
    markers = (OPEN, FUNCTION)

    def region_end(self, marker: str, text: str) -> int | Scan:
        if marker == FUNCTION:
            end = text.find(FUNCTION_END)
            if end < 0:
                return Scan.MORE
            end += len(FUNCTION_END)
            after = text[end:].lstrip()
            if not after or CLOSE.startswith(after):
                return Scan.MORE  # a stray </tool_call> may follow
            if after.startswith(CLOSE):
                return len(text) - len(after) + len(CLOSE)
            return end
        close = text.find(CLOSE)
        reopen = text.find(OPEN)
        if reopen >= 0 and (close < 0 or reopen < close):
            return reopen
        return Scan.MORE if close < 0 else close + len(CLOSE)

    def closes_at_end(self, marker: str, text: str) -> bool:
        return marker == FUNCTION and text.rstrip().endswith(FUNCTION_END)

    def parse_region(self, marker: str, region: str, complete: bool) -> list[RawCall] | None:
        body = region
        if marker == FUNCTION:
            body = FUNCTION + body
        body = body.strip()
        if body.endswith(CLOSE):
            body = body[: -len(CLOSE)].rstrip()
        source = marker + region
        if not body.startswith(FUNCTION):
            if body[:1] in "{[":  # a Hermes JSON body in the XML family's wrapper
                repairs: list[str] = []
                return calls_from_json(parse_json_body(body, self.config, repairs), source, repairs)
            return None
        calls: list[RawCall] = []
        blocks = list(_FUNCTION.finditer(body))
        for block in blocks:
            repairs = ["unwrapped"] if marker == FUNCTION else []
            name = block.group(1).strip()
            if not block.group(0).rstrip().endswith(FUNCTION_END):
                repairs.append("unclosed")
            arguments: dict[str, Any] = {}
            for param in _PARAM.finditer(block.group(2)):
                key = param.group(1).strip()
                value = param.group(2)
                if not param.group(0).rstrip().endswith("</parameter>"):
                    repairs.append("unclosed")
                    value = value.rstrip("\n")
                arguments[key] = self._value(name, key, value, repairs)
            raw = block.group(0) if len(blocks) > 1 else source
            calls.append(RawCall(name, arguments, raw, list(dict.fromkeys(repairs))))
        return calls or None

    def _value(self, tool: str, key: str, text: str, repairs: list[str]) -> Any:
        schema = self.tools[tool].parameters.get("properties", {}).get(key, {}) if tool in self.tools else {}
        kind = schema.get("type") if isinstance(schema, dict) else None
        if kind == "string" or (isinstance(kind, list) and kind and kind[0] == "string"):
            return text
        try:
            return json.loads(text)
        except ValueError:
            pass
        if kind in ("object", "array") and self.config.enabled and self.config.repair_json:
            try:
                value, _ = loads_tolerant(text)
            except JsonRepairError:
                return text
            repairs.append("json")
            return value
        return text  # a plain word where no schema says string: the guardrails decide
