"""What a generation yields, above the engine: the events every API renders.

Plain slotted dataclasses, built per token on the hot path; no validation here. A tool call is
`ToolCallStart` followed by one or more `ToolCallArgs` fragments that concatenate to the call's
arguments JSON; a call is complete when the next call starts or the generation finishes.
`Finish` is always the last event of a choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishKind = Literal["stop", "length", "tool_calls", "cancelled"]


@dataclass(slots=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top: list[tuple[str, int, float]] = field(default_factory=list)  # (text, id, logprob)


@dataclass(slots=True)
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class ReasoningDelta:
    text: str


@dataclass(slots=True)
class ToolCallStart:
    index: int  # 0, 1, ... within this choice
    id: str
    name: str


@dataclass(slots=True)
class ToolCallArgs:
    index: int
    delta: str


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class Finish:
    reason: FinishKind
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0


@dataclass(slots=True)
class Ping:
    """Nothing new yet (a long prefill): lets SSE APIs keep an idle client connection alive."""


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgs | Finish | Ping
