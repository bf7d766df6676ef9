"""Hermes / Qwen style calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence

from turbospark.backend import GuardrailConfig
from turbospark.events import TextDelta, ToolCallArgs, ToolCallStart
from turbospark.request import Tool
from turbospark.toolcalls import ToolEvent

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class HermesParser:
    def __init__(self, tools: Sequence[Tool], guardrails: GuardrailConfig) -> None:
        self.tools = {t.name: t for t in tools}
        self.guardrails = guardrails
        self.num_calls = 0
        self.buf = ""
        self.in_call = False

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self.buf += text
        while self.buf:
            if self.in_call:
                at = self.buf.find(CLOSE)
                if at < 0:
                    break
                body, self.buf = self.buf[:at], self.buf[at + len(CLOSE) :]
                self.in_call = False
                out.extend(self._emit(body))
                continue
            at = self.buf.find(OPEN)
            if at >= 0:
                if at:
                    out.append(TextDelta(self.buf[:at]))
                self.buf = self.buf[at + len(OPEN) :]
                self.in_call = True
                continue
            hold = 0
            for size in range(min(len(OPEN) - 1, len(self.buf)), 0, -1):
                if self.buf.endswith(OPEN[:size]):
                    hold = size
                    break
            if len(self.buf) > hold:
                out.append(TextDelta(self.buf[: len(self.buf) - hold]))
            self.buf = self.buf[len(self.buf) - hold :]
            break
        return out

    def _emit(self, body: str) -> list[ToolEvent]:
        try:
            obj = json.loads(body)
            name = obj["name"]
            args = obj.get("arguments", {})
            if not isinstance(name, str) or not isinstance(args, dict):
                raise ValueError("bad call shape")
        except (ValueError, KeyError, TypeError):
            return [TextDelta(OPEN + body + CLOSE)]
        index = self.num_calls
        self.num_calls += 1
        return [
            ToolCallStart(index, new_call_id(), name),
            ToolCallArgs(index, json.dumps(args, ensure_ascii=False)),
        ]

    def finish(self) -> list[ToolEvent]:
        rest = (OPEN if self.in_call else "") + self.buf
        self.buf, self.in_call = "", False
        return [TextDelta(rest)] if rest else []
