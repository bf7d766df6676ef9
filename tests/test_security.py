"""Who may call the server and from where: API keys in every API, CORS, routes nobody serves."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer, ServerProcess

KEY = "k-123"
MESSAGES = [{"role": "user", "content": "hi"}]
CHAT = {"model": "scripted", "messages": MESSAGES}

# (method, path, body, envelope) for every authenticated route.
GUARDED = [
    ("POST", "/v1/chat/completions", CHAT, "openai"),
    ("POST", "/v1/completions", {"model": "scripted", "prompt": "hi"}, "openai"),
    ("GET", "/v1/models", None, "openai"),
    ("GET", "/v1/models/scripted", None, "openai"),
    ("POST", "/v1/responses", {"model": "scripted", "input": "hi"}, "openai"),
    ("GET", "/v1/responses/resp_1", None, "openai"),
    ("POST", "/v1/messages", {**CHAT, "max_tokens": 5}, "anthropic"),
    ("POST", "/v1/messages/count_tokens", CHAT, "anthropic"),
    ("POST", "/api/chat", CHAT, "ollama"),
    ("POST", "/api/generate", {"model": "scripted", "prompt": "hi"}, "ollama"),
    ("GET", "/api/tags", None, "ollama"),
    ("POST", "/api/show", {"model": "scripted"}, "ollama"),
    ("GET", "/api/ps", None, "ollama"),
    ("POST", "/tokenize", {"model": "scripted", "prompt": "hi"}, "openai"),
    ("POST", "/detokenize", {"model": "scripted", "tokens": [1]}, "openai"),
    ("GET", "/openapi.json", None, "openai"),
]


def assert_envelope(reply: httpx.Response, envelope: str, status: int) -> None:
    assert reply.status_code == status, (reply.request.url, reply.text)
    assert reply.headers["content-type"].startswith("application/json")
    body = reply.json()
    if envelope == "openai":
        assert isinstance(body["error"]["message"], str) and body["error"]["type"]
    elif envelope == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] and body["error"]["message"]
    else:
        assert isinstance(body["error"], str) and body["error"]


@pytest.fixture(scope="module")
def guarded() -> Iterator[LiveServer]:
    with LiveServer([ScriptedChatModel(["fine"])], api_keys=[KEY, "second-key"]) as server:
        yield server


@pytest.mark.parametrize(("method", "path", "body", "envelope"), GUARDED)
def test_every_route_wants_a_key_in_its_own_envelope(
    guarded: LiveServer, method: str, path: str, body: object, envelope: str
) -> None:
    no_key = httpx.request(method, guarded.url + path, json=body)
    assert_envelope(no_key, envelope, 401)
    assert "API key" in no_key.text
    wrong = httpx.request(method, guarded.url + path, json=body, headers={"x-api-key": "nope"})
    assert_envelope(wrong, envelope, 401)
    for headers in ({"authorization": f"Bearer {KEY}"}, {"x-api-key": "second-key"}):
        ok = httpx.request(method, guarded.url + path, json=body, headers=headers)
        assert ok.status_code != 401, ok.text


def test_open_routes_stay_open(guarded: LiveServer) -> None:
    assert httpx.get(guarded.url + "/health").json()["status"] == "ok"
    assert httpx.get(guarded.url + "/").status_code == 200  # Ollama's liveness probe
    assert httpx.get(guarded.url + "/api/version").status_code == 200
    assert httpx.get(guarded.url + "/metrics").status_code == 200


def test_real_clients_see_their_own_auth_errors(guarded: LiveServer) -> None:
    with (
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", max_retries=0) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.chat.completions.create(model="scripted", messages=MESSAGES)  # type: ignore[arg-type]
    with (
        anthropic.Anthropic(base_url=guarded.url, api_key="wrong", max_retries=0) as claude,
        pytest.raises(anthropic.AuthenticationError),
    ):
        claude.messages.create(model="scripted", max_tokens=5, messages=MESSAGES)  # type: ignore[arg-type]
    with (
        ollama.Client(host=guarded.url, headers={"authorization": "Bearer wrong"}) as bad,
        pytest.raises(ollama.ResponseError) as info,
    ):
        bad.chat(model="scripted", messages=MESSAGES)
    assert info.value.status_code == 401
    with ollama.Client(host=guarded.url, headers={"authorization": f"Bearer {KEY}"}) as good:
        assert good.chat(model="scripted", messages=MESSAGES).message.content == "fine"


def test_keys_from_a_file_and_the_environment(tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("# one key per line\nfrom-file\n\n", encoding="utf-8")
    args = ["--model", "scripted", "--api-key-file", str(keys), "--api-key", "from-flag"]
    with ServerProcess(*args, env={"TURBOSPARK_API_KEY": "from-env"}) as server:
        url = server.url + "/v1/models"
        for key in ("from-file", "from-flag", "from-env"):
            assert httpx.get(url, headers={"authorization": f"Bearer {key}"}).status_code == 200
        assert_envelope(httpx.get(url, headers={"authorization": "Bearer # one key per line"}), "openai", 401)
        assert httpx.get(server.url + "/health").status_code == 200


def test_binds_loopback_by_default() -> None:
    from turbospark.cli import parser

    assert parser().parse_args(["serve"]).host == "127.0.0.1"


@pytest.fixture(scope="module")
def plain() -> Iterator[LiveServer]:
    with LiveServer([ScriptedChatModel(["fine"])]) as server:
        yield server


@pytest.mark.parametrize(
    ("method", "path", "envelope", "status"),
    [
        ("GET", "/nope", "openai", 404),
        ("GET", "/v1/nope", "openai", 404),
        ("POST", "/api/nope", "ollama", 404),
        ("GET", "/v1/chat/completions", "openai", 405),
        ("GET", "/v1/messages", "anthropic", 405),
        ("DELETE", "/api/chat", "ollama", 405),
        ("OPTIONS", "/v1/chat/completions", "openai", 405),  # CORS is off: no preflight answer
    ],
)
def test_unrouted_requests_get_a_json_error(
    plain: LiveServer, method: str, path: str, envelope: str, status: int
) -> None:
    reply = httpx.request(method, plain.url + path)
    assert_envelope(reply, envelope, status)
    assert "access-control-allow-origin" not in reply.headers
    if status == 405:
        assert reply.headers["allow"]


def test_cors_preflight_and_headers_for_allowed_origins() -> None:
    allowed = "http://app.example"
    with LiveServer([ScriptedChatModel(["fine"])], cors_origins=[allowed], api_keys=[KEY]) as server:
        preflight = httpx.options(
            server.url + "/v1/chat/completions",
            headers={
                "origin": allowed,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type, x-stainless-os",
            },
        )
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == allowed
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        reply = httpx.post(
            server.url + "/v1/chat/completions",
            json=CHAT,
            headers={"origin": allowed, "authorization": f"Bearer {KEY}"},
        )
        assert reply.status_code == 200 and reply.headers["access-control-allow-origin"] == allowed
        other = httpx.post(
            server.url + "/v1/chat/completions", json=CHAT, headers={"origin": "http://evil.example"}
        )
        assert "access-control-allow-origin" not in other.headers
