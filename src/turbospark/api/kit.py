"""What every API's reply side shares: starting a stream, collecting a non-streaming choice,
SSE / NDJSON framing, logprob entries and usage sums.

`start_stream` waits for a choice's first event before the HTTP reply begins, so an error that
comes before it (a full queue, a prompt the backend refuses) is still a plain HTTP error in the
caller's envelope; what it returns yields that first event and then the rest. On the engine's
direct path that first event is a `Ping` as soon as the request is in the engine's line, so the
reply's headers and opening event (`message_start`, `response.created`) never wait for a
queued request's first token. `collect` runs
choices to their end for a non-streaming reply; `CollectedChoice` is the one accumulator every
API renders from.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import orjson
from starlette.requests import Request
from starlette.responses import StreamingResponse

from turbospark.api.common import until_disconnect, until_shutdown
from turbospark.events import (
    Event,
    Finish,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallArgs,
    ToolCallStart,
    Usage,
)
from turbospark.generate import stream_choice
from turbospark.plan import Plan

# ---------------------------------------------------------------- streams


async def start_stream(
    request: Request, plan: Plan, ping_interval: float | None = None, index: int = 0
) -> AsyncGenerator[Event, None]:
    """Starts one choice and waits for its first event (see the module docstring). What it
    returns is bounded by the server's shutdown (`until_shutdown`)."""
    # stream_choice is an async generator: closing it stops the generation.
    stream = until_shutdown(
        request, cast(AsyncGenerator[Event, None], stream_choice(plan, index, ping_interval))
    )
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        first = None
    return _rejoined(first, stream)


async def _rejoined(first: Event | None, rest: AsyncGenerator[Event, None]) -> AsyncGenerator[Event, None]:
    try:
        if first is not None:
            yield first
        async for event in rest:
            yield event
    finally:
        with contextlib.suppress(BaseException):  # torn down on disconnect: stop generating
            await rest.aclose()


async def choice_streams(
    request: Request, plan: Plan, first: AsyncIterator[Event], ping_interval: float | None
) -> AsyncIterator[tuple[int, AsyncIterator[Event]]]:
    """Choice 0 (already started) and then each further choice of `plan.request.n`, in turn,
    each bounded by the server's shutdown like the first."""
    yield 0, first
    for index in range(1, plan.request.n):
        yield index, until_shutdown(request, stream_choice(plan, index, ping_interval))


# ---------------------------------------------------------------- non-streaming


@dataclass(slots=True)
class CollectedCall:
    id: str
    name: str
    arguments: str = ""  # JSON text of an object


@dataclass(slots=True)
class Segment:
    """A run of one kind of output, in the order the model wrote it."""

    kind: Literal["text", "reasoning", "tool_call"]
    text: str = ""  # the text or reasoning
    call: CollectedCall | None = None


@dataclass(slots=True)
class CollectedChoice:
    """One choice's events, gathered for a non-streaming reply."""

    segments: list[Segment] = field(default_factory=list)
    calls: list[CollectedCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_event: Finish | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, TextDelta | ReasoningDelta):
            kind: Literal["text", "reasoning"] = "text" if isinstance(event, TextDelta) else "reasoning"
            if isinstance(event, TextDelta) and event.logprobs:
                self.logprobs.extend(event.logprobs)
            if not event.text:
                return
            if self.segments and self.segments[-1].kind == kind:
                self.segments[-1].text += event.text
            else:
                self.segments.append(Segment(kind, event.text))
        elif isinstance(event, ToolCallStart):
            call = CollectedCall(event.id, event.name)
            self.calls.append(call)
            self.segments.append(Segment("tool_call", call=call))
        elif isinstance(event, ToolCallArgs):
            self.calls[event.index].arguments += event.delta
        elif isinstance(event, Finish):
            self.finish_event = event

    def joined(self, *kinds: str) -> str:
        return "".join(s.text for s in self.segments if s.kind in kinds)

    @property
    def text(self) -> str:
        return self.joined("text")

    @property
    def reasoning(self) -> str:
        return self.joined("reasoning")

    @property
    def finish(self) -> Finish:
        assert self.finish_event is not None, "a choice always ends with Finish"
        return self.finish_event


async def collect(request: Request, plan: Plan) -> list[CollectedChoice]:
    """Every choice of `plan`, run to its end; a client that leaves cancels the generation."""

    async def run() -> list[CollectedChoice]:
        choices = []
        for index in range(plan.request.n):
            choice = CollectedChoice()
            async for event in stream_choice(plan, index):
                choice.add(event)
            choices.append(choice)
        return choices

    return await until_disconnect(request, run())


def sum_usage(finishes: list[Finish]) -> Usage:
    """Usage over a request's choices: the prompt once, every choice's completion."""
    total = Usage(
        prompt_tokens=finishes[0].usage.prompt_tokens, cached_tokens=finishes[0].usage.cached_tokens
    )
    for fin in finishes:
        total.completion_tokens += fin.usage.completion_tokens
        total.reasoning_tokens += fin.usage.reasoning_tokens
    return total


# ---------------------------------------------------------------- rendering pieces


def logprob_entry(lp: TokenLogprob) -> dict[str, Any]:
    """One token's logprob as OpenAI chat, Responses and Ollama write it."""
    return {
        "token": lp.token,
        "logprob": lp.logprob,
        "bytes": list(lp.token.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, _, v in lp.top],
    }


def logprob_entries(entries: list[TokenLogprob] | None) -> list[dict[str, Any]]:
    return [logprob_entry(e) for e in entries or []]


def tool_arguments(arguments: str) -> dict[str, Any] | None:
    """A call's arguments JSON text as an object (None if the text is not one)."""
    try:
        value = orjson.loads(arguments) if arguments.strip() else {}
    except orjson.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


# ---------------------------------------------------------------- framing

SSE_PING = b": ping\n\n"  # an SSE comment: keeps the connection alive, ignored by clients
SSE_DONE = b"data: [DONE]\n\n"
NDJSON = "application/x-ndjson"


def sse_data(data: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def sse_event(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def ndjson_line(data: dict[str, Any]) -> bytes:
    return orjson.dumps(data) + b"\n"


def ndjson_response(body: AsyncIterator[bytes]) -> StreamingResponse:
    return StreamingResponse(body, media_type=NDJSON)
