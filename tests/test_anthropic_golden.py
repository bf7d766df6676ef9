"""One whole /v1/messages SSE stream pinned byte for byte (ids and the signature normalised).

Thinking, text and a tool call in one reply, so every block type and delta kind is framed.
Regenerate after an intended change with TURBOSPARK_UPDATE_GOLDEN=1.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx

from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

GOLDEN = Path(__file__).parent / "golden" / "anthropic_stream_thinking_tool.sse"
REPLY = (
    "<think>Need the weather.</think>Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
REQUEST = {
    "model": "claude-turbospark-scripted",
    "max_tokens": 256,
    "stream": True,
    "system": "You are terse.",
    "thinking": {"type": "enabled", "budget_tokens": 1024},
    "tools": [
        {
            "name": "get_weather",
            "description": "Current weather for a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ],
    "messages": [{"role": "user", "content": "Weather in Paris?"}],
}


def normalise(stream: bytes) -> bytes:
    stream = re.sub(rb'"msg_[0-9a-f]{24}"', b'"msg_ID"', stream)
    stream = re.sub(rb'"toolu_[0-9a-f]{24}"', b'"toolu_ID"', stream)
    return re.sub(rb'"signature":"[A-Za-z0-9+/=]+"', b'"signature":"SIGNATURE"', stream)


def test_stream_matches_golden() -> None:
    with LiveServer([ScriptedChatModel([REPLY])]) as server:
        response = httpx.post(
            server.url + "/v1/messages", json=REQUEST, headers={"anthropic-version": "2023-06-01"}, timeout=30
        )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    got = normalise(response.content)
    if os.environ.get("TURBOSPARK_UPDATE_GOLDEN"):
        GOLDEN.write_bytes(got)
    assert got == GOLDEN.read_bytes()
