"""`turbospark chat`: a small terminal chat that streams from the same backend and pipeline.

It goes through the plan step and the output pipeline like an HTTP request does (templates,
stop strings, reasoning split), minus HTTP. Reasoning is shown dimmed; `/reset` clears history,
`/quit` (or end of input) leaves.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from turbospark.backend import ChatModel, ReasoningEffort
from turbospark.events import Finish, ReasoningDelta, TextDelta, ToolCallArgs, ToolCallStart
from turbospark.generate import stream_choice
from turbospark.plan import make_plan
from turbospark.registry import ModelRegistry
from turbospark.request import ChatRequest, Message, SamplingParams

DIM, RESET = "\x1b[2m", "\x1b[0m"


async def _reply(registry: ModelRegistry, request: ChatRequest, out: TextIO, color: bool) -> str:
    plan = make_plan(request, registry)
    text: list[str] = []
    in_reasoning = False
    async for event in stream_choice(plan):
        if isinstance(event, ReasoningDelta):
            if not in_reasoning and color:
                out.write(DIM)
            in_reasoning = True
            out.write(event.text)
        elif isinstance(event, TextDelta):
            if in_reasoning:
                out.write(RESET + "\n" if color else "\n")
                in_reasoning = False
            out.write(event.text)
            text.append(event.text)
        elif isinstance(event, ToolCallStart):
            out.write(f"\n[tool call {event.name}] ")
        elif isinstance(event, ToolCallArgs):
            out.write(event.delta)
        elif isinstance(event, Finish):
            if in_reasoning and color:
                out.write(RESET)
            if event.reason == "length":
                out.write(" [stopped: length]")
        out.flush()
    out.write("\n")
    return "".join(text)


def run_chat(
    backend: ChatModel,
    *,
    system: str | None = None,
    temperature: float = 0.7,
    max_tokens: int = 512,
    reasoning: ReasoningEffort | None = None,
    stdin: TextIO = sys.stdin,
    stdout: TextIO = sys.stdout,
) -> int:
    registry = ModelRegistry()
    registry.add(backend)
    history: list[Message] = [Message("system", system)] if system else []
    color = stdout.isatty()
    stdout.write(f"turbospark chat with {backend.model_id} (/reset, /quit)\n")
    while True:
        stdout.write("> ")
        stdout.flush()
        line = stdin.readline()
        if not line or line.strip() == "/quit":
            return 0
        if line.strip() == "/reset":
            history = history[:1] if system else []
            continue
        if not line.strip():
            continue
        history.append(Message("user", line.rstrip("\n")))
        request = ChatRequest(
            model=backend.model_id,
            messages=list(history),
            sampling=SamplingParams(temperature=temperature),
            max_tokens=max_tokens,
            reasoning_effort=reasoning,
        )
        answer = asyncio.run(_reply(registry, request, stdout, color))
        history.append(Message("assistant", answer))
