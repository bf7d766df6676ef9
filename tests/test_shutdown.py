"""SIGTERM with streams open: every stream ends on a whole frame, then the process exits 0.

Four streams (OpenAI chat, Anthropic messages, Responses, Ollama chat) run against a
`turbospark serve` process with a paced decode. After SIGTERM each one is read to its end:
it either finishes normally inside the grace period, or ends with a final error event in its
own API's stream format. Every frame must parse; nothing may be cut mid-frame.
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import pytest

from turbospark.testing import ServerProcess

LONG_REPLY = "tock " * 600
MESSAGES = [{"role": "user", "content": "hi"}]


@dataclass
class Stream:
    api: str
    path: str
    body: dict[str, object]
    raw: bytearray = field(default_factory=bytearray)
    started: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


def streams(max_tokens: int) -> list[Stream]:
    return [
        Stream("openai", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": max_tokens}),
        Stream("anthropic", "/v1/messages", {"messages": MESSAGES, "max_tokens": max_tokens}),
        Stream("responses", "/v1/responses", {"input": "hi", "max_output_tokens": max_tokens}),
        Stream("ollama", "/api/chat", {"messages": MESSAGES, "options": {"num_predict": max_tokens}}),
    ]


def read(url: str, stream: Stream) -> None:
    body = {"model": "scripted", "stream": True, **stream.body}
    try:
        with httpx.stream("POST", url + stream.path, json=body, timeout=120) as reply:
            assert reply.status_code == 200, reply.read()
            for chunk in reply.iter_raw():
                stream.raw += chunk
                if len(stream.raw) > 2000:  # well past the opening frames: tokens are flowing
                    stream.started.set()
    except BaseException as exc:
        stream.error = exc
    finally:
        stream.started.set()


def frames(stream: Stream) -> list[dict[str, object]]:
    """The stream's frames, parsed; fails on any frame that is not whole."""
    text = bytes(stream.raw).decode()
    if stream.api == "ollama":
        assert text.endswith("\n"), text[-200:]
        return [orjson.loads(line) for line in text.splitlines()]
    assert text.endswith("\n\n"), text[-200:]
    out: list[dict[str, object]] = []
    for block in text[:-2].split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        if not fields:
            continue  # a ping comment
        data = fields["data"]
        out.append({"event": fields.get("event"), "data": None if data == "[DONE]" else orjson.loads(data)})
    return out


def ended_with_error(stream: Stream, parsed: list[dict[str, object]]) -> bool:
    last = parsed[-1]
    if stream.api == "openai":
        return isinstance(last["data"], dict) and "error" in last["data"]
    if stream.api == "anthropic":
        return last["event"] == "error"
    if stream.api == "responses":
        return last["event"] == "response.failed"
    return "error" in last


def finished_normally(stream: Stream, parsed: list[dict[str, object]]) -> bool:
    last = parsed[-1]
    if stream.api == "openai":
        return last["data"] is None  # [DONE]
    if stream.api == "anthropic":
        return last["event"] == "message_stop"
    if stream.api == "responses":
        return last["event"] in ("response.completed", "response.incomplete")  # incomplete: max tokens
    return last.get("done") is True


def run_and_terminate(tmp_path: Path, grace: str, max_tokens: int) -> tuple[list[Stream], int, str]:
    script = tmp_path / "reply.txt"
    script.write_text(LONG_REPLY, encoding="utf-8")
    args = ["--model", f"scripted:{script}", "--max-active", "4", "--max-decode-rate", "100"]
    with ServerProcess(*args, "--shutdown-timeout", grace) as server:
        open_streams = streams(max_tokens)
        readers = [threading.Thread(target=read, args=(server.url, s)) for s in open_streams]
        for reader in readers:
            reader.start()
        for s in open_streams:
            s.started.wait(60)
        status = server.terminate()
        for reader in readers:
            reader.join(60)
        return open_streams, status, server.log()


def test_sigterm_ends_open_streams_with_an_error_event_and_exits_0(tmp_path: Path) -> None:
    open_streams, status, log = run_and_terminate(tmp_path, grace="0.5", max_tokens=2000)
    assert status == 0, log
    for s in open_streams:
        assert s.error is None, (s.api, s.error)
        parsed = frames(s)
        assert ended_with_error(s, parsed), (s.api, parsed[-2:])
    assert "Traceback" not in log, log


def test_sigterm_lets_streams_finish_within_the_grace_period(tmp_path: Path) -> None:
    open_streams, status, log = run_and_terminate(tmp_path, grace="120", max_tokens=300)
    assert status == 0, log
    for s in open_streams:
        assert s.error is None, (s.api, s.error)
        parsed = frames(s)
        assert finished_normally(s, parsed), (s.api, parsed[-2:])
    assert "Traceback" not in log, log


def test_requests_after_sigterm_are_refused(tmp_path: Path) -> None:
    script = tmp_path / "reply.txt"
    script.write_text(LONG_REPLY, encoding="utf-8")
    args = ["--model", f"scripted:{script}", "--max-decode-rate", "100", "--shutdown-timeout", "30"]
    with ServerProcess(*args) as server, httpx.Client(timeout=30) as client:
        body = {"model": "scripted", "messages": MESSAGES, "stream": True, "max_tokens": 400}
        with client.stream("POST", server.url + "/v1/chat/completions", json=body) as holder:
            lines = holder.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)
            # The kept-alive connection of this client is closed or answered 503; a new one is refused.
            with pytest.raises(httpx.ConnectError):
                for _ in range(100):
                    reply = httpx.get(server.url + "/v1/models", timeout=5)
                    assert reply.status_code == 503 and "error" in reply.json()
                    threading.Event().wait(0.1)
            rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"  # the open stream still finished in its grace period
        assert server.proc.wait(60) == 0
