"""Small things other servers' clients and test suites rely on: a seed outside the 64-bit range
is a 400 naming it (vLLM's test_long_seed), a prompt over the context carries OpenAI's
`context_length_exceeded` code, and a request with no model (llama.cpp's clients send none) is
served by `--fallback-model` where one is set."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from turbospark.api.common import ServerState
from turbospark.registry import ModelRegistry
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer


def client_for(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_seed_outside_64_bits_is_refused() -> None:
    with LiveServer([ScriptedChatModel(["ok"])]) as server, client_for(server) as client:
        hi: Any = [{"role": "user", "content": "hi"}]
        for seed in (2**63, -(2**63) - 1, 2**64 + 5):
            with pytest.raises(openai.BadRequestError, match="'seed' must be") as caught:
                client.chat.completions.create(model="scripted", messages=hi, seed=seed)
            assert caught.value.param == "seed"  # type: ignore[attr-defined]
        with pytest.raises(openai.BadRequestError, match="'seed'"):
            client.completions.create(model="scripted", prompt="hi", seed=2**64)
        for seed in (2**63 - 1, -(2**63), 0):
            reply = client.chat.completions.create(model="scripted", messages=hi, seed=seed)
            assert reply.choices[0].message.content == "ok"


def test_context_length_exceeded_code() -> None:
    backend = ScriptedChatModel(["ok"], max_context=64)
    with LiveServer([backend]) as server, client_for(server) as client:
        long = "word " * 100
        with pytest.raises(openai.BadRequestError, match="does not fit") as caught:
            client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": long}])
        assert caught.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(model="scripted", input=long)
        assert caught.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="scripted", prompt=long)
        assert caught.value.code == "context_length_exceeded"
        # Other 400s keep no code.
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="scripted", messages=[], max_tokens=1)
        assert caught.value.code is None


def test_missing_model_is_served_by_the_fallback() -> None:
    registry = ModelRegistry(fallback="scripted")
    registry.add(ScriptedChatModel(["ok"]))
    with LiveServer(state=ServerState(registry=registry)) as server:
        hi = [{"role": "user", "content": "hi"}]
        for model in ({}, {"model": None}):
            chat = httpx.post(server.url + "/v1/chat/completions", json={**model, "messages": hi})
            assert chat.status_code == 200, chat.text
            assert chat.json()["model"] == "scripted"
            assert chat.json()["choices"][0]["message"]["content"] == "ok"
            message = httpx.post(server.url + "/v1/messages", json={**model, "messages": hi, "max_tokens": 8})
            assert message.status_code == 200 and message.json()["model"] == "scripted"
            response = httpx.post(server.url + "/v1/responses", json={**model, "input": "hi"})
            assert response.status_code == 200 and response.json()["model"] == "scripted"
            completion = httpx.post(server.url + "/v1/completions", json={**model, "prompt": "hi"})
            assert completion.status_code == 200 and completion.json()["model"] == "scripted"

    with LiveServer([ScriptedChatModel(["ok"])]) as server:
        hi = [{"role": "user", "content": "hi"}]
        refused = httpx.post(server.url + "/v1/chat/completions", json={"messages": hi})
        assert refused.status_code == 400
        assert (
            refused.json()["error"]["param"] == "model" and "fallback" in refused.json()["error"]["message"]
        )
        refused = httpx.post(server.url + "/v1/messages", json={"messages": hi, "max_tokens": 8})
        assert refused.status_code == 400 and refused.json()["type"] == "error"
