"""Faults a server meets in the wild: clients that give up, generations that fail, bad models.

Disconnects are tested through HTTP against a `turbospark serve` process with one generation
slot and a paced decode, so a slot that leaked would make the next request wait forever (the
client's timeout turns that into a failure), whatever the scheduler does inside.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from turbospark.testing import ServerProcess

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
