"""Records the request bodies of a real Claude Code session, for `bench_agent.py` to replay.

Starts turbospark on loopback with a scripted backend (no weights; a context large enough for
Claude Code's ~80k-byte first request under the byte tokenizer) behind a small ASGI layer that
saves every `POST /v1/messages` body as received, then drives the real `claude` CLI headless
(telemetry off, a throwaway HOME, the non-streaming fallback off) through:

1. "Run the shell command: cat notes.txt": the backend answers with a Bash tool call;
2. the follow-up carrying the tool_result, answered with text;
3. a second user turn in the same conversation (`claude -p --continue`), answered with text.

The bodies are written as a JSON list of {"label", "body"} exactly as Claude Code sent them,
including the attribution line in `system` that changes per request (the server drops it).

    python benchmarks/record_claude_session.py [--out benchmarks/data/claude_code_session.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import uvicorn

from turbospark.api.common import ServerState
from turbospark.backend import CancelFlag, CompletionResult, GenerationConfig, ProgressCallback, RequestImage
from turbospark.registry import ModelRegistry
from turbospark.scripted import ScriptedChatModel
from turbospark.server import create_app
from turbospark.testing import claude_env, free_port

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "claude_code_session.json"
MODEL = "claude-turbospark-local"
API_KEY = "dummy"
MAX_CONTEXT = 262144  # Claude Code's first request is ~80k bytes; the scripted tokenizer is bytewise

NOTES = "Release checklist\n- bump the version\n- tag the commit\n- write the changelog\n"
FIRST_PROMPT = "Run the shell command: cat notes.txt"
SECOND_PROMPT = "How many items are on that checklist? Answer with one number."
TOOL_REPLY = (
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "cat notes.txt", '
    '"description": "Show notes.txt"}}\n</tool_call>'
)
TEXT_REPLIES = [
    "notes.txt is a release checklist: bump the version, tag the commit, write the changelog.",
    "3",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class SessionModel(ScriptedChatModel):
    """Asks for Bash until a tool result is in the prompt, then answers with the next text reply.

    Chosen by prompt rather than by arrival order, so an extra request Claude Code may send
    cannot shift the script.
    """

    def __init__(self) -> None:
        super().__init__(TEXT_REPLIES, model_id="local", max_context=MAX_CONTEXT)
        self.asker = ScriptedChatModel([TOOL_REPLY], model_id="local", max_context=MAX_CONTEXT)

    def run_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        if "<tools>" in text and "<tool_response>" not in text:
            return self.asker.run_completion(prompt_ids, config, images, cancel, on_progress)
        return super().run_completion(prompt_ids, config, images, cancel, on_progress)


class BodyRecorder:
    """ASGI middleware: keeps a copy of every POST /v1/messages body and passes it on unchanged."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.bodies: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != "/v1/messages":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []

        async def recording_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    body = json.loads(b"".join(chunks))
                    with self.lock:
                        self.bodies.append(body)
            return message

        await self.app(scope, recording_receive, send)


def label_of(body: dict[str, Any], user_turn: int) -> tuple[str, int]:
    """("turn N" | "turn N tool_result", the user turn count so far) for a recorded body."""
    last = body["messages"][-1]
    content = last.get("content")
    blocks = content if isinstance(content, list) else []
    if last.get("role") == "user" and any(b.get("type") == "tool_result" for b in blocks):
        return f"turn {user_turn} tool_result", user_turn
    return f"turn {user_turn + 1}", user_turn + 1


def run_claude(claude: str, url: str, home: Path, work: Path, prompt: str, *extra: str) -> dict[str, Any]:
    env = claude_env(home, url, API_KEY)
    cmd = [claude, "-p", prompt, "--model", MODEL, "--output-format", "json", *extra]
    done = subprocess.run(
        cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise SystemExit(
            f"claude failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    result: dict[str, Any] = json.loads(lines[-1])
    if result.get("is_error"):
        raise SystemExit(f"claude reported an error: {result}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    claude = shutil.which("claude")
    if claude is None:
        raise SystemExit("Claude Code (`claude`) is not on PATH: npm install -g @anthropic-ai/claude-code")
    version = subprocess.run([claude, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()

    registry = ModelRegistry()
    registry.add(SessionModel())
    recorder = BodyRecorder(create_app(ServerState(registry=registry, api_keys=frozenset([API_KEY]))))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(recorder, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("the recording server did not start")
        time.sleep(0.01)

    url = f"http://127.0.0.1:{port}"
    try:
        with tempfile.TemporaryDirectory(prefix="claude-record-") as tmp:
            home, work = Path(tmp) / "home", Path(tmp) / "work"
            home.mkdir()
            work.mkdir()
            (work / "notes.txt").write_text(NOTES, encoding="utf-8")
            first = run_claude(claude, url, home, work, FIRST_PROMPT, "--allowedTools", "Bash(cat:*)")
            second = run_claude(claude, url, home, work, SECOND_PROMPT, "--continue")
    finally:
        server.should_exit = True
        thread.join(timeout=10)

    records: list[dict[str, Any]] = []
    turn = 0
    for body in recorder.bodies:
        label, turn = label_of(body, turn)
        records.append({"label": label, "body": body})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"Claude Code {version}: first turn -> {first['result']!r}; second turn -> {second['result']!r}")
    for record in records:
        size = len(json.dumps(record["body"], ensure_ascii=False).encode())
        print(f"  {record['label']:<20} {len(record['body']['messages'])} messages, {size:,} bytes of JSON")
    print(f"wrote {len(records)} request bodies to {args.out}")


if __name__ == "__main__":
    main()
