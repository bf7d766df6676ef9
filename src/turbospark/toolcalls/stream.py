"""The streaming machinery every tool-call family shares.

The answer text is in one of two modes. In *text* mode it streams out as `TextDelta`, except a
tail that could still become a call marker (held until it cannot). A marker switches to *region*
mode: text is buffered until the family says where the region ends, then the region is parsed
into calls, each call goes through the guardrails, and either `ToolCallStart` + the whole
`ToolCallArgs` come out, or the raw text is released as text (never dropped). Because a call is
only emitted once complete, streaming and non-streaming produce the same events whatever the
token boundaries.

Whitespace that only separates calls (or precedes the first) is dropped, so a reply made of
calls has no stray "\\n" content. A family may also accept a bare JSON call at the very start of
the answer (Llama 3 writes calls that way; small Qwen models put them in a code fence), or after
a short junk prefix there (`JUNK_CHARS`, see `junk_prefix_end`): a small model sometimes writes
`>{"name": ...}`. The junk is dropped with the call, as that whitespace is (the call counts as
repaired, kind `junk_prefix`), and comes back as text with the rest if what follows is not a
call. Text after the call is text as after any call (a closing backtick included). With
`fenced_after_text` a code fence anywhere in the text opens a region too: a JSON object in the
shape of a call to a declared tool there is a call; anything else in it (code, a package.json, a
call to an unknown tool) comes back as the text it was, not counted as a failed call.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from turbospark.events import TextDelta, ToolCallArgs, ToolCallStart
from turbospark.metrics import TOOL_CALL_REJECTS, TOOL_CALL_REPAIRS, TOOL_CALLS
from turbospark.request import Tool
from turbospark.toolcalls.guardrails import (
    CheckedCall,
    GuardrailConfig,
    JsonRepairError,
    finalize_call,
    loads_tolerant,
    match_tool_name,
)

ToolEvent = TextDelta | ToolCallStart | ToolCallArgs


def new_call_id() -> str:
    """A fresh call id: 24 hex digits. Each API adds its own prefix (`call_`, `toolu_`)."""
    return uuid.uuid4().hex[:24]


class Scan(Enum):
    MORE = "more"  # the region is not complete yet
    NOT_A_CALL = "not_a_call"  # a bare candidate turned out to be ordinary text


# A bare call may follow a junk prefix at the answer's start: at most MAX_JUNK of these
# characters (no letter or digit, no quote or bracket), each followed by at most MAX_JUNK_GAP
# spaces, tabs or newlines. The lazy call constraint (`turbospark.grammar`) uses the same rule.
JUNK_CHARS = ">:-*`#|~=+.,;!"
MAX_JUNK = 3
MAX_JUNK_GAP = 8
JUNK_GAP_CHARS = " \t\n"
# a code fence: with `fenced_after_text`, where a call written after text may open
FENCE = "```"


def junk_prefix_end(text: str) -> int | Scan:
    """For answer text past its leading whitespace: where a bare call's `{` starts after a junk
    prefix (0 when the text opens with it), `Scan.MORE` while the prefix could still lead to one,
    `Scan.NOT_A_CALL` once it cannot (a letter, a quote, a fourth junk character, a long gap...).

    The decision depends only on the text up to the character that makes it, so it does not
    depend on how the answer was chunked. A code fence (three backticks) is not junk: the fence
    rule reads it.
    """
    if text.startswith("```"):
        return Scan.NOT_A_CALL
    i, n, count = 0, len(text), 0
    while i < n:
        ch = text[i]
        if ch == "{":
            return i
        if ch not in JUNK_CHARS or count == MAX_JUNK:
            return Scan.NOT_A_CALL
        count += 1
        i += 1
        gap = i
        while i < n and text[i] in JUNK_GAP_CHARS:
            i += 1
        if i - gap > MAX_JUNK_GAP:
            return Scan.NOT_A_CALL
    return Scan.MORE


@dataclass(slots=True)
class RawCall:
    """One call as the model wrote it, before the guardrails."""

    name: Any
    arguments: Any
    raw: str  # the source text, released as text if the call is rejected
    repairs: list[str] = field(default_factory=list)


@dataclass(slots=True)
class CallStats:
    """What happened to this choice's calls (tests and the corpus report read it)."""

    num_ok: int = 0
    num_repaired: int = 0
    num_as_text: int = 0
    rejections: list[str] = field(default_factory=list)


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class JsonScan:
    """Finds where the object or array opening at `start` ends, resumably: a region grows one
    token at a time, and rescanning it from its start each time would cost O(n^2).

    Counts brackets outside strings only. Single-quoted strings count as strings where a value
    can start, so a tolerant body such as `{'a': 'x}'}` still ends in the right place.
    """

    __slots__ = ("depth", "done", "last", "pos", "quote")

    def __init__(self, start: int) -> None:
        self.pos = start
        self.depth = 0
        self.quote = ""
        self.last = ""  # the last non-space character outside strings
        self.done: int | None = None

    def end(self, text: str) -> int | None:
        """Index just past the value in `text` (which only grows between calls), or None."""
        if self.done is not None:
            return self.done
        i, n = self.pos, len(text)
        depth, quote, last = self.depth, self.quote, self.last
        while i < n:
            ch = text[i]
            if quote:
                if ch == "\\":
                    if i + 1 >= n:
                        break  # the escaped character has not arrived yet
                    i += 2
                    continue
                if ch == quote:
                    quote = ""
                    last = ch
            elif ch == '"' or (ch == "'" and last in "{[:,"):
                quote = ch
            elif ch in "{[":
                depth += 1
                last = ch
            elif ch in "}]":
                depth -= 1
                last = ch
                if depth <= 0:
                    self.done = i + 1
                    return self.done
            elif not ch.isspace():
                last = ch
            i += 1
        self.pos, self.depth, self.quote, self.last = i, depth, quote, last
        return None


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the object or array that opens at `text[start]`; None if unfinished."""
    return JsonScan(start).end(text)


def parse_json_body(text: str, config: GuardrailConfig, repairs: list[str]) -> Any:
    """Strict JSON, or tolerant JSON when the guardrails allow it (noting the repair)."""
    try:
        return json.loads(text)
    except ValueError:
        if not (config.enabled and config.repair_json):
            raise
    value, repaired = loads_tolerant(text)
    if repaired:
        repairs.append("json")
    return value


_ARG_KEYS = ("arguments", "parameters", "args", "input", "params")


def call_from_object(obj: Any, raw: str, repairs: list[str]) -> RawCall | None:
    """`{"name": ..., "arguments": ...}` and its common variants, or None if not call-shaped."""
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function")
    if isinstance(fn, dict):  # the OpenAI wire shape {"type": "function", "function": {...}}
        obj = fn
    name = obj.get("name", obj.get("tool_name", fn if isinstance(fn, str) else None))
    if name is None:
        return None
    for key in _ARG_KEYS:
        if key in obj:
            return RawCall(name, obj[key], raw, list(repairs))
    rest = {k: v for k, v in obj.items() if k not in ("name", "type", "id", "function", "tool_name")}
    fixes = [*repairs, "shape"] if rest else list(repairs)
    return RawCall(name, rest, raw, fixes)


def calls_from_json(value: Any, raw: str, repairs: list[str]) -> list[RawCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = [call_from_object(item, raw if len(items) == 1 else json.dumps(item), repairs) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


class StreamToolParser:
    """Base class: a family sets `markers` and implements `region_end` and `parse_region`."""

    markers: tuple[str, ...] = ()
    special_markers: tuple[str, ...] = ()  # special tokens the detokenizer must not skip
    bare_json = False  # a JSON call (maybe in a code fence) may open the answer
    bare_is_native = False  # the family's own format is bare JSON (then a miss is a failed call)
    # with `bare_json`: a code-fenced JSON call to a declared tool after text is a call too
    fenced_after_text = False

    def __init__(self, tools: Sequence[Tool], guardrails: GuardrailConfig) -> None:
        self.tools: Mapping[str, Tool] = {t.name: t for t in tools}
        self.config = guardrails
        self.num_calls = 0
        self.stats = CallStats()
        self.buf = ""
        self.marker: str | None = None  # None: text mode; "": a bare JSON region; else its opener
        self.at_start = True  # no answer text has come out yet
        self.ws = ""  # trailing whitespace held back: it may only separate calls
        self.after_call = False
        self.region_ws = ""  # whitespace (and junk) before the open region: restored if it is not a call
        self.scans: dict[int, JsonScan] = {}  # resumable JSON scans over the open region

    def json_end(self, text: str, start: int) -> int | None:
        """`json_value_end` over the open region, resumed from where the last call stopped."""
        scan = self.scans.get(start)
        if scan is None:
            scan = self.scans[start] = JsonScan(start)
        return scan.end(text)

    # ---------------------------------------------------------------- family hooks

    def region_end(self, marker: str, text: str) -> int | Scan:
        """Where the region opened by `marker` ends in `text` (exclusive), or a `Scan`."""
        raise NotImplementedError

    def closes_at_end(self, marker: str, text: str) -> bool:
        """Whether a region still open at the end of the output is nonetheless complete (a
        family whose region end needs a look at what follows)."""
        return False

    def parse_region(self, marker: str, region: str, complete: bool) -> list[RawCall] | None:
        """The calls in a region; None if it is not parseable. `complete` is False at the end
        of the output when the region never closed."""
        raise NotImplementedError

    # ---------------------------------------------------------------- streaming

    def feed(self, text: str) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self.buf += text
        while self._scan_region(out) if self.marker is not None else self._scan_text(out):
            pass
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if self.marker is not None:
            marker, region = self.marker, self.buf
            self.marker, self.buf = None, ""
            self.scans.clear()
            if marker == "" and not region.strip():
                pass
            else:
                self._emit_region(out, marker, region, complete=self.closes_at_end(marker, region))
        if self.buf:
            self._emit_text(out, self.buf)
            self.buf = ""
        if self.ws and not self.after_call and self.num_calls == 0:
            out.append(TextDelta(self.ws))
        self.ws = ""
        return out

    def _scan_text(self, out: list[ToolEvent]) -> bool:
        buf = self.buf
        if self.at_start and self.bare_json:
            stripped = buf.lstrip()
            if not stripped or "```".startswith(stripped):
                return False  # could still open a bare call
            start = 0 if stripped[0] in "{[" or stripped.startswith("```") else junk_prefix_end(stripped)
            if start is Scan.MORE:
                return False  # a junk prefix that could still lead to a bare call
            if isinstance(start, int):
                skip = len(buf) - len(stripped) + start
                self.region_ws, self.ws = self.ws + buf[:skip], ""
                self.marker, self.buf, self.at_start = "", buf[skip:], False
                return True
        markers = (*self.markers, FENCE) if self.fenced_after_text else self.markers
        best: tuple[int, str] | None = None
        for marker in markers:
            at = buf.find(marker)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, marker)
        if best is not None:
            at, marker = best
            self._emit_text(out, buf[:at])
            self.region_ws, self.ws = self.ws, ""  # whitespace before a call only separates
            self.marker, self.buf = marker, buf[at + len(marker) :]
            self.at_start = False
            return True
        hold = max((partial_suffix(buf, m) for m in markers), default=0)
        self._emit_text(out, buf[: len(buf) - hold])
        self.buf = buf[len(buf) - hold :]
        return False

    def _scan_region(self, out: list[ToolEvent]) -> bool:
        assert self.marker is not None
        if self.marker == FENCE:
            end = bare_region_end(FENCE + self.buf, self.json_end)
            if isinstance(end, int):
                end -= len(FENCE)
        else:
            end = self.region_end(self.marker, self.buf)
        if end is Scan.MORE:
            return False
        self.scans.clear()  # the region is over: its buffer is about to be cut
        if end is Scan.NOT_A_CALL:
            self._emit_text(out, self._take_region_ws() + self.marker)
            self.marker = None
            self.at_start = False
            return True
        assert isinstance(end, int)
        marker, region, self.buf = self.marker, self.buf[:end], self.buf[end:]
        self.marker = None
        self._emit_region(out, marker, region, complete=True)
        return True

    def _emit_text(self, out: list[ToolEvent], text: str) -> None:
        if not text:
            return
        if self.after_call:
            text = text.lstrip()
            if not text:
                return
            self.after_call = False
        text = self.ws + text
        body = text.rstrip()
        self.ws = text[len(body) :]
        if body:
            out.append(TextDelta(body))
            self.at_start = False

    # ---------------------------------------------------------------- calls

    def _emit_region(self, out: list[ToolEvent], marker: str, region: str, complete: bool) -> None:
        source = marker + region
        calls: list[RawCall] | None
        try:
            if marker == FENCE:
                calls = parse_bare(source, self.config)
            else:
                calls = self.parse_region(marker, region, complete)
        except (ValueError, JsonRepairError):
            calls = None
        if calls is not None and not complete:
            if not (self.config.enabled and self.config.repair_json):
                calls = None  # an unclosed call is only repaired by the guardrails
            else:
                for call in calls:
                    call.repairs.append("unclosed")
        bare = marker in ("", FENCE)
        # A JSON answer is only a call if it names a declared tool (unless bare JSON is the
        # family's own call syntax); a fenced one after text, only in the shape of a call
        if (
            calls is not None
            and bare
            and (not self.bare_is_native or marker == FENCE)
            and not all(isinstance(c.name, str) and self._declared(c.name) for c in calls)
        ):
            calls = None
        if calls is not None and marker == FENCE and any("shape" in c.repairs for c in calls):
            calls = None
        if calls is not None and bare and self.region_ws.strip():
            for call in calls:
                call.repairs.append("junk_prefix")  # dropped with the call, as whitespace is
        if calls is None:
            if not bare or (marker == "" and self.bare_is_native and _looks_like_call(region)):
                self._reject(out, source, "parse", "the call could not be parsed")
            else:
                self._emit_text(out, self._take_region_ws() + source)
            return
        results = [finalize_call(c.name, c.arguments, self.tools, self.config, c.repairs) for c in calls]
        if not any(isinstance(r, CheckedCall) for r in results):
            first = results[0]
            assert not isinstance(first, CheckedCall)
            self._reject(out, source, first.reason, first.detail)
            return
        for call, result in zip(calls, results, strict=True):
            if isinstance(result, CheckedCall):
                self._emit_call(out, result)
            else:
                self._reject(out, call.raw, result.reason, result.detail)
        self.after_call = True
        self.ws = self.region_ws = ""

    def _take_region_ws(self) -> str:
        ws, self.region_ws = self.region_ws, ""
        return ws

    def _declared(self, name: str) -> bool:
        if name in self.tools:
            return True
        if not (self.config.enabled and self.config.match_names):
            return False
        return match_tool_name(name, list(self.tools)) is not None

    def _emit_call(self, out: list[ToolEvent], call: CheckedCall) -> None:
        index = self.num_calls
        self.num_calls += 1
        out.append(ToolCallStart(index, new_call_id(), call.name))
        out.append(ToolCallArgs(index, call.arguments))
        self.ws = ""
        if call.repairs:
            self.stats.num_repaired += 1
            TOOL_CALLS.labels(outcome="repaired").inc()
            for kind in call.repairs:
                TOOL_CALL_REPAIRS.labels(kind=kind).inc()
        else:
            self.stats.num_ok += 1
            TOOL_CALLS.labels(outcome="ok").inc()

    def _reject(self, out: list[ToolEvent], source: str, reason: str, detail: str) -> None:
        self.stats.num_as_text += 1
        self.stats.rejections.append(f"{reason}: {detail}")
        TOOL_CALLS.labels(outcome="returned_as_text").inc()
        TOOL_CALL_REJECTS.labels(reason=reason).inc()
        self.after_call = False
        text = self.ws + self._take_region_ws() + source
        self.ws = ""
        if text:
            out.append(TextDelta(text))
            self.at_start = False


def _looks_like_call(region: str) -> bool:
    return '"name"' in region or "'name'" in region


def bare_region_end(text: str, json_end: Callable[[str, int], int | None] = json_value_end) -> int | Scan:
    """End of a bare JSON call at the answer start: `{...}`, `[...]` or a fenced one."""
    i = 0
    fenced = text.startswith("```")
    if fenced:
        newline = text.find("\n", 0, 24)  # only the fence's first line decides
        if newline < 0:
            return Scan.MORE if len(text) < 24 else Scan.NOT_A_CALL
        header = text[3:newline].strip().lower()
        if header not in ("", "json", "json5", "tool_call", "tool_code", "javascript"):
            return Scan.NOT_A_CALL
        i = newline + 1
    while i < len(text) and text[i].isspace():
        i += 1
    if i >= len(text):
        return Scan.MORE
    if text[i] not in "{[":
        return Scan.NOT_A_CALL
    end = json_end(text, i)
    if end is None:
        return Scan.MORE
    if fenced:
        close = text.find("```", end)
        if close < 0:
            tail = text[end:]
            return Scan.MORE if not tail.strip() or "```".startswith(tail.strip()) else end
        return close + 3
    return end


def parse_bare(region: str, config: GuardrailConfig) -> list[RawCall] | None:
    repairs: list[str] = []
    body = region.strip()
    if body.startswith("```"):
        repairs.append("code_fence")
        body = body[3:]
        newline = body.find("\n")
        body = body[newline + 1 :] if newline >= 0 else ""
        if body.rstrip().endswith("```"):
            body = body.rstrip()[:-3]
    value = parse_json_body(body, config, repairs)
    return calls_from_json(value, region, repairs)
