"""Mistral calls after the `[TOOL_CALLS]` control token.

Two generations of the format: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3
tokenizers) and `[TOOL_CALLS]name[ARGS]{...}` (v11 and later, one marker per call, sometimes
with `[CALL_ID]id` before `[ARGS]`). The markers are special tokens, which the detokenizer keeps
for this family (`special_markers`).
"""

from __future__ import annotations

import re

from turbospark.toolcalls.stream import (
    RawCall,
    Scan,
    StreamToolParser,
    calls_from_json,
    json_value_end,
    parse_json_body,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w*\s*)?$")


class MistralParser(StreamToolParser):
    markers = (TOOL_CALLS,)
    special_markers = (TOOL_CALLS, ARGS, CALL_ID)

    def region_end(self, marker: str, text: str) -> int | Scan:
        stripped = text.lstrip()
        if not stripped:
            return Scan.MORE
        start = len(text) - len(stripped)
        if stripped[0] in "{[":
            end = json_value_end(text, start)
            return Scan.MORE if end is None else end
        args = text.find(ARGS)
        if args < 0:
            # A name is short and has no spaces; anything else never becomes a call.
            return Scan.MORE if _NAME.match(text) or len(text) < 64 else len(text)
        i = args + len(ARGS)
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return Scan.MORE
        if text[i] not in "{[":
            return i  # unparseable: parse_region rejects it
        end = json_value_end(text, i)
        return Scan.MORE if end is None else end

    def parse_region(self, marker: str, region: str, complete: bool) -> list[RawCall] | None:
        repairs: list[str] = []
        body = region.strip()
        if body[:1] in "{[":
            return calls_from_json(parse_json_body(body, self.config, repairs), marker + region, repairs)
        head, sep, args = body.partition(ARGS)
        named = _NAME.match(head)
        if not sep or named is None:
            return None
        arguments = parse_json_body(args.strip(), self.config, repairs) if args.strip() else {}
        return [RawCall(named.group(1), arguments, marker + region, repairs)]
