"""The real Codex CLI, run by `turbospark launch codex`, against `turbospark serve --model
qwen2.5-coder:0.5b` (no other flag but an API key), asked to run a shell command.

Codex's first request carries its instructions and about nine tools (~38k bytes); each later
turn resends it all, and the prefix cache carries it. Whether a 0.5B model calls the
`exec_command` tool is its own choice: the test holds that the session completes (Codex ends
the turn without an error) and, when the model did call the tool on the file, that the command
really ran (its output holds the file's marker).
The transcript's summary is printed, so a run shows which of the two happened.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from test_codex_cli import API_KEY, items, launch_codex
from turbospark.engine.pull import pulled_path
from turbospark.testing import ServerProcess

MODEL = "qwen2.5-coder:0.5b"
MARKER = "turbospark-notes-4711"
CODEX_TIMEOUT_S = 1200  # generous: the first turn's prefill runs on two cores in CI

pytestmark = [
    pytest.mark.slow,
    pytest.mark.codex,
    pytest.mark.skipif(
        pulled_path(MODEL) is None and not os.environ.get("TURBOSPARK_REQUIRE_MODELS"),
        reason=f"run `python -m turbospark.engine.pull {MODEL}` first",
    ),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    cache = {k: os.environ[k] for k in ("HOME", "TURBOSPARK_CACHE", "XDG_CACHE_HOME") if k in os.environ}
    with ServerProcess("--model", MODEL, "--api-key", API_KEY, env=cache) as served:
        yield served


def test_codex_shell_session_on_qwen_05b(codex: str, server: ServerProcess, tmp_path: Path) -> None:
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text(f"{MARKER}\n")
    prompt = "Run the shell command: cat notes.txt"
    events, _ = launch_codex(server, tmp_path, prompt, model=MODEL, timeout=CODEX_TIMEOUT_S)
    commands = items(events, "command_execution")
    messages = items(events, "agent_message")
    print(json.dumps({"commands": commands, "messages": messages, "usage": events[-1].get("usage")})[:3000])
    assert commands or messages, events
    for command in commands:
        if "notes.txt" in command["command"] and command["exit_code"] == 0:
            assert MARKER in command["aggregated_output"]
