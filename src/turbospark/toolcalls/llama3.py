"""Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}` as the whole answer.

Llama 3.1 may prefix the call with the `<|python_tag|>` special token; several calls are joined
with `;`. A bare JSON object at the start of the answer is the native form here, so one that
cannot be read is a failed call (returned as text and counted), not ordinary content.
"""

from __future__ import annotations

from turbospark.toolcalls.stream import (
    RawCall,
    Scan,
    StreamToolParser,
    bare_region_end,
    calls_from_json,
    json_value_end,
    parse_bare,
    parse_json_body,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3Parser(StreamToolParser):
    markers = (PYTHON_TAG,)
    special_markers = (PYTHON_TAG,)
    bare_json = True
    bare_is_native = True

    def region_end(self, marker: str, text: str) -> int | Scan:
        if marker == "" and text.startswith("```"):
            return bare_region_end(text, self.json_end)
        i, last_end = 0, -1
        while True:
            while i < len(text) and text[i].isspace():
                i += 1
            if i >= len(text):
                return Scan.MORE
            if text[i] not in "{[":
                return Scan.NOT_A_CALL if last_end < 0 else last_end
            end = self.json_end(text, i)
            if end is None:
                return Scan.MORE
            j = end
            while j < len(text) and text[j] in " \t":
                j += 1
            if j >= len(text):
                return Scan.MORE  # a ';' and another call may follow
            if text[j] != ";":
                return end
            last_end, i = end, j + 1

    def closes_at_end(self, marker: str, text: str) -> bool:
        body = text.strip()
        return body[:1] in "{[" and json_value_end(body, 0) is not None and body[-1] in "}]"

    def parse_region(self, marker: str, region: str, complete: bool) -> list[RawCall] | None:
        body = region.strip()
        if body.startswith("```"):
            return parse_bare(body, self.config)
        calls: list[RawCall] = []
        i = 0
        while i < len(body):
            while i < len(body) and (body[i].isspace() or body[i] == ";"):
                i += 1
            if i >= len(body):
                break
            end = json_value_end(body, i) or len(body)
            chunk = body[i:end]
            repairs: list[str] = []
            found = calls_from_json(parse_json_body(chunk, self.config, repairs), marker + chunk, repairs)
            if found is None:
                return None
            calls += found
            i = end
        if len(calls) == 1:
            calls[0].raw = marker + region
        return calls or None
