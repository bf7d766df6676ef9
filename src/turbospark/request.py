"""The one internal chat request every wire format parses into.

Each API module (OpenAI, Anthropic, Ollama, Responses) validates its body once and builds a
`ChatRequest`; nothing past this point knows which API a request came in on. Tool-call
arguments are kept as JSON text, the canonical form every API can render from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

from turbospark.backend import ReasoningEffort, RequestImage

Role = Literal["system", "developer", "user", "assistant", "tool"]


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(slots=True)
class Message:
    role: Role
    content: str = ""
    images: list[RequestImage] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None  # the tool's name on a tool message
    reasoning: str | None = None  # an assistant turn's earlier thinking


def empty_object_schema() -> dict[str, Any]:
    """The parameters schema of a tool that declares none: an object with no properties."""
    return {"type": "object", "properties": {}}


@dataclass(slots=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=empty_object_schema)
    strict: bool = False


class ToolChoiceMode(StrEnum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"  # OpenAI "required", Anthropic "any"
    NAMED = "named"  # one specific tool


@dataclass(slots=True)
class ToolChoice:
    """The caller's tool_choice. The plan enforces it: `none` drops the tools, `required` needs
    tools, a named tool must be declared."""

    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None
    # Where and how the caller wrote it (`tool_choice.type`, "any"), so a refusal quotes them.
    where: str = "tool_choice"
    as_written: str = ""


@dataclass(slots=True)
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict[str, Any] | None = None
    name: str | None = None
    strict: bool = False


@dataclass(slots=True)
class SamplingParams:
    # None: the request left it unset, and the plan takes the served model's default
    # (`registry.ServedModel.sampling`); a value the caller sent is used as sent (0 = off for
    # top_k and min_p, 1.0 = off for top_p and repetition_penalty, temperature 0 = greedy).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(slots=True, weakref_slot=True)  # weakly held: the registry's lease on its model
class ChatRequest:
    model: str
    messages: list[Message]
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int | None = None  # None: as much as the context allows
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    n: int = 1
    # Reasoning, resolved by the plan against the served model's default:
    reasoning_effort: ReasoningEffort | None = None  # a level the caller named (OFF: no thinking)
    thinking_budget: int | None = None  # max reasoning tokens; picks the level when none is named
    thinking_on: bool = False  # thinking asked for without a level: the default, else medium
    # The start of the reply, written by the caller (a final assistant turn): the reply continues it.
    prefill: str | None = None
    # A raw prompt skips the chat template (OpenAI /v1/completions, Ollama raw generate).
    prompt: str | None = None
    add_special_tokens: bool = True
    # Prefix-cache isolation (`GenerationConfig.cache_salt`): the body's `cache_salt` and/or the
    # caller's API key, combined by `api/common.cache_salt`.
    cache_salt: str | None = None

    def images(self) -> list[RequestImage]:
        return [img for m in self.messages for img in m.images]
