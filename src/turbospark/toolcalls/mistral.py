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
    parse_json_body,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
MAX_HEADER = 96
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
            end = self.json_end(text, start)
            return Scan.MORE if end is None else end
        # A call's header (name, maybe a call id) is short; the decision only looks at its
        # first MAX_HEADER characters, so it does not depend on how the text was chunked.
        args = text.find(ARGS, 0, MAX_HEADER)
        if args < 0:
            return Scan.MORE if len(text) < MAX_HEADER else Scan.NOT_A_CALL
        i = args + len(ARGS)
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return Scan.MORE
        if text[i] not in "{[":
            return i  # unparseable: parse_region rejects it
        end = self.json_end(text, i)
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
