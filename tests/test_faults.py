"""Faults a server meets in the wild: clients that give up, generations that fail, bad models.

Disconnects are tested through HTTP against a `turbospark serve` process with one generation
slot and a paced decode, so a slot that leaked would make the next request wait forever (the
client's timeout turns that into a failure), whatever the scheduler does inside.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer, ServerProcess

LONG_REPLY = "tick " * 400  # 2,000 byte tokens: 10 s at the paced rate below


@pytest.fixture
def one_slot(tmp_path: Path) -> Iterator[ServerProcess]:
    script = tmp_path / "replies.txt"
    script.write_text(LONG_REPLY, encoding="utf-8")
    args = ["--model", f"scripted:{script}", "--max-active", "1", "--max-decode-rate", "200"]
    with ServerProcess(*args, "--log-level", "info") as server:
        yield server


def chat_body(stream: bool, max_tokens: int | None = None) -> dict[str, object]:
    body: dict[str, object] = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}]}
    body["stream"] = stream
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body


def finishes(server: ServerProcess) -> None:
    """A short request completes: the one slot is free again."""
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat_body(False, 5), timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "tick "


def assert_clean_log(server: ServerProcess) -> None:
    log = server.log()
    assert "Traceback" not in log and "InvalidStateError" not in log and "ERROR" not in log, log


def test_non_streaming_client_that_gives_up_frees_its_slot(one_slot: ServerProcess) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(one_slot.url + "/v1/chat/completions", json=chat_body(False), timeout=0.5)
    finishes(one_slot)
    assert_clean_log(one_slot)


def test_stream_closed_mid_way_frees_its_slot(one_slot: ServerProcess) -> None:
    with httpx.stream("POST", one_slot.url + "/v1/chat/completions", json=chat_body(True), timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    finishes(one_slot)
    assert_clean_log(one_slot)


def test_client_that_gives_up_while_queued_leaves_the_line(one_slot: ServerProcess) -> None:
    url = one_slot.url + "/v1/chat/completions"
    with httpx.stream("POST", url, json=chat_body(True), timeout=30) as holder:
        lines = holder.iter_lines()  # kept: dropping the iterator closes the connection
        assert next(lines).startswith("data: ")
        # The slot is taken: these wait in line, then give up.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json=chat_body(False), timeout=0.5)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(one_slot.url + "/v1/messages", json={**chat_body(False), "max_tokens": 9}, timeout=0.5)
        assert next(line for line in lines if line).startswith("data: ")  # the holder still streams
    finishes(one_slot)
    assert_clean_log(one_slot)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/api/chat"])
def test_client_that_hangs_up_while_sending_its_body_is_no_server_error(
    one_slot: ServerProcess, path: str
) -> None:
    body = orjson.dumps(chat_body(True))
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    head += f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", one_slot.port), timeout=10) as sock:
        sock.sendall(head.encode() + body[: len(body) // 2])
    finishes(one_slot)
    assert_clean_log(one_slot)


class FailsOnBoom(ScriptedChatModel):
    """Raises mid-generation (after a few tokens) when the prompt says "boom"."""

    def run_completion(self, prompt_ids, config, images, cancel, on_progress):  # type: ignore[no-untyped-def]
        if "boom" not in self.tokenizer.decode(list(prompt_ids)):
            return super().run_completion(prompt_ids, config, images, cancel, on_progress)
        seen = 0

        def progress(token):  # type: ignore[no-untyped-def]
            nonlocal seen
            seen += 1
            if seen == 3:
                raise RuntimeError("kernel fault in layer 7")
            on_progress(token)

        return super().run_completion(prompt_ids, config, images, cancel, progress)


STREAMS = {
    "openai": ("/v1/chat/completions", {"max_tokens": 50}),
    "anthropic": ("/v1/messages", {"max_tokens": 50}),
    "ollama": ("/api/chat", {}),
}


def test_a_failing_generation_ends_its_own_stream_with_an_error_event() -> None:
    with LiveServer([FailsOnBoom(["all good here"])]) as server:
        for api, (path, extra) in STREAMS.items():
            body = {
                "model": "scripted",
                "stream": True,
                "messages": [{"role": "user", "content": "boom"}],
                **extra,
            }
            with httpx.stream("POST", server.url + path, json=body, timeout=30) as reply:
                assert reply.status_code == 200
                lines = [line for line in reply.iter_lines() if line]
            last = lines[-1]
            if api == "openai":
                assert "kernel fault" in orjson.loads(last.removeprefix("data: "))["error"]["message"]
            elif api == "anthropic":
                assert lines[-2] == "event: error" and "kernel fault" in last
            else:
                assert "kernel fault" in orjson.loads(last)["error"]
            # The next request on the same server is served as usual.
            ok = httpx.post(server.url + "/v1/chat/completions", json=chat_body(False), timeout=30)
            assert ok.json()["choices"][0]["message"]["content"] == "all good here"


def test_a_model_file_that_cannot_load_names_the_file_and_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x00" * 64)
    server = ServerProcess("--model", str(broken))
    try:
        assert server.proc.wait(timeout=120) != 0
        log = server.log()
        assert "broken.gguf" in log and "cannot load model" in log, log
    finally:
        server.__exit__(None, None, None)
