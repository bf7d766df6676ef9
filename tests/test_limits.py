"""Every request limit, in every API it applies to: a 4xx in that API's envelope naming it."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from turbospark.api.common import ServerState
from turbospark.backend import VisionInfo
from turbospark.limits import Limits, check_schema, schema_depth
from turbospark.registry import ModelRegistry
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer

LIMITS = Limits(
    max_body_bytes=50_000,
    max_messages=3,
    max_prompt_tokens=1500,
    max_output_tokens=100,
    max_stop=2,
    max_stop_chars=10,
    max_tools=2,
    max_schema_bytes=2_000,
    max_schema_depth=6,
    max_images=1,
    max_image_bytes=1_000,
    max_image_pixels=1_000_000,
)
APIS = ["openai", "anthropic", "ollama", "responses"]


class SeeingScripted(ScriptedChatModel):
    """Claims a vision tower, so requests with images reach the image limits (the scripted
    backend itself still refuses images once a generation starts)."""

    def vision(self) -> VisionInfo | None:
        return VisionInfo(max_pixels=LIMITS.max_image_pixels, image_token="<image>")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    registry = ModelRegistry(limits=LIMITS)
    registry.add(SeeingScripted(["fine"]))
    state = ServerState(registry=registry, max_body_bytes=LIMITS.max_body_bytes)
    with LiveServer(state=state) as live:
        yield live


def png(width: int, height: int, size: int = 64) -> str:
    """A PNG header claiming width x height, padded to `size` bytes, as base64."""
    head = bytes.fromhex("89504e470d0a1a0a0000000d49484452")
    raw = head + width.to_bytes(4, "big") + height.to_bytes(4, "big") + b"\x08\x02\x00\x00\x00"
    return base64.b64encode(raw.ljust(size, b"\0")).decode()


def tool(api: str, name: str, schema: dict[str, Any]) -> dict[str, Any]:
    if api == "anthropic":
        return {"name": name, "input_schema": schema}
    if api == "responses":
        return {"type": "function", "name": name, "parameters": schema}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


def send(server: LiveServer, api: str, **ask: Any) -> httpx.Response:
    """One request in `api`'s shape; `ask` says what to push against a limit."""
    turns = ask.get("turns", ["hi"])
    messages: list[dict[str, Any]] = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)
    ]
    if "image" in ask:
        image = ask["image"]
        if api == "openai":
            parts = [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}}] * ask.get(
                "num_images", 1
            )
            messages[0]["content"] = [{"type": "text", "text": "see"}, *parts]
        elif api == "anthropic":
            block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": image}}
            messages[0]["content"] = [{"type": "text", "text": "see"}] + [block] * ask.get("num_images", 1)
        else:
            messages[0]["images"] = [image] * ask.get("num_images", 1)
    body: dict[str, Any] = {"model": "scripted"}
    if api == "responses":
        body["input"] = messages
    else:
        body["messages"] = messages
    max_tokens = ask.get("max_tokens", 5)
    stop = ask.get("stop")
    if api == "openai":
        body |= {"max_tokens": max_tokens} | ({"stop": stop} if stop else {})
        path = "/v1/chat/completions"
    elif api == "anthropic":
        body |= {"max_tokens": max_tokens} | ({"stop_sequences": stop} if stop else {})
        path = "/v1/messages"
    elif api == "ollama":
        body |= {"stream": False, "options": {"num_predict": max_tokens} | ({"stop": stop} if stop else {})}
        path = "/api/chat"
    else:
        body["max_output_tokens"] = max_tokens
        path = "/v1/responses"
    if "tools" in ask:
        body["tools"] = [tool(api, f"t{i}", s) for i, s in enumerate(ask["tools"])]
    if "schema" in ask:
        if api == "openai":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": ask["schema"]},
            }
        elif api == "anthropic":
            body["output_config"] = {"format": {"type": "json_schema", "schema": ask["schema"]}}
        elif api == "ollama":
            body["format"] = ask["schema"]
        else:
            body["text"] = {"format": {"type": "json_schema", "name": "s", "schema": ask["schema"]}}
    if "pad" in ask:
        body["metadata" if api == "anthropic" else "padding"] = {"x": "y" * ask["pad"]}
    return httpx.post(server.url + path, json=body, timeout=30)


def refused(reply: httpx.Response, api: str, *words: str, status: int | None = None) -> str:
    assert 400 <= reply.status_code < 500, reply.text
    if status is not None:
        assert reply.status_code == status, reply.text
    body = reply.json()
    if api == "anthropic":
        assert body["type"] == "error"
        message = body["error"]["message"]
    elif api == "ollama":
        message = body["error"]
    else:
        message = body["error"]["message"]
    for word in words:
        assert word in message, message
    return str(message)


def deep(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("api", APIS)
def test_within_every_limit_is_served(server: LiveServer, api: str) -> None:
    reply = send(server, api, turns=["a", "b", "c"], stop=["x", "y"], tools=[deep(2)] * 2)
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("api", APIS)
def test_body_size(server: LiveServer, api: str) -> None:
    refused(send(server, api, pad=60_000), api, "body", "limit", status=413)


@pytest.mark.parametrize("api", APIS)
def test_message_count(server: LiveServer, api: str) -> None:
    refused(
        send(server, api, turns=["a", "b", "c", "d", "e"]), api, "5 messages", "--max-messages", status=413
    )


@pytest.mark.parametrize("api", APIS)
def test_prompt_tokens(server: LiveServer, api: str) -> None:
    refused(send(server, api, turns=["word " * 400]), api, "--max-prompt-tokens", "1500")


@pytest.mark.parametrize("api", APIS)
def test_max_tokens(server: LiveServer, api: str) -> None:
    refused(send(server, api, max_tokens=101), api, "--max-output-tokens", "100")


def test_n(server: LiveServer) -> None:
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "n": 17}
    reply = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "n"


@pytest.mark.parametrize("api", ["openai", "anthropic", "ollama"])
def test_stop_strings(server: LiveServer, api: str) -> None:
    refused(send(server, api, stop=["a", "b", "c"]), api, "3 stop strings", "limit is 2")
    refused(send(server, api, stop=["a" * 11]), api, "11 characters", "limit is 10")


@pytest.mark.parametrize("api", APIS)
def test_tool_count(server: LiveServer, api: str) -> None:
    refused(send(server, api, tools=[deep(1)] * 3), api, "3 tools", "--max-tools", status=413)


@pytest.mark.parametrize("api", APIS)
def test_schema_size_and_depth(server: LiveServer, api: str) -> None:
    huge = {"type": "string", "enum": [f"value-{i}" for i in range(300)]}
    refused(send(server, api, tools=[huge]), api, "JSON schema", "max_schema_bytes", status=413)
    refused(send(server, api, tools=[deep(10)]), api, "deeper", "max_schema_depth")
    refused(send(server, api, schema=deep(10)), api, "deeper", "max_schema_depth")


@pytest.mark.parametrize("api", ["openai", "anthropic", "ollama"])
def test_image_bytes_pixels_and_count(server: LiveServer, api: str) -> None:
    refused(send(server, api, image=png(10, 10, size=2_000)), api, "2000 bytes", "--max-image-bytes")
    refused(send(server, api, image=png(5000, 4000)), api, "5000x4000", "--max-image-pixels")
    refused(send(server, api, image=png(10, 10), num_images=2), api, "2 images", "limit is 1")
    refused(send(server, api, image=base64.b64encode(b"not an image").decode()), api, "not a PNG")
    # Within every image limit the request gets past them (and then fails: the scripted
    # backend's text-only template cannot render an image part).
    assert "limit" not in refused(send(server, api, image=png(10, 10)), api)


def test_a_text_only_model_refuses_images_before_their_limits() -> None:
    registry = ModelRegistry(limits=LIMITS)
    registry.add(ScriptedChatModel(["fine"]))
    with LiveServer(state=ServerState(registry=registry)) as text_only:
        refused(send(text_only, "openai", image=png(5000, 4000)), "openai", "cannot read images")


def test_schema_depth_counts_without_recursion() -> None:
    very_deep: Any = "leaf"
    for _ in range(100_000):
        very_deep = [very_deep]
    assert schema_depth(very_deep, 64) == 65  # stops counting past the limit
    with pytest.raises(Exception, match="max_schema_depth"):
        check_schema({"x": very_deep}, "tools[0].parameters", Limits())
