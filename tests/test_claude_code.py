"""The real Claude Code CLI, headless, against a loopback server.

Run with telemetry off, a throwaway HOME and the non-streaming fallback disabled, so a broken
stream fails the run instead of being retried without streaming. These tests skip only when
`claude` is not on PATH and TURBOSPARK_REQUIRE_CLAUDE is unset; CI installs the CLI
(`npm install -g @anthropic-ai/claude-code`) and sets that variable, so there they always run.
"""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from turbospark.backend import CancelFlag, CompletionResult, GenerationConfig, ProgressCallback, RequestImage
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer, claude_env

pytestmark = pytest.mark.claude

API_KEY = "turbospark-test-key"
# Claude Code's system prompt and ~25 tool schemas come to ~80k bytes; the scripted tokenizer
# spends one token per byte.
MAX_CONTEXT = 262144


def run_claude(
    claude: str,
    server: LiveServer,
    tmp_path: Path,
    prompt: str,
    model: str,
    *extra: str,
    discovery: bool = False,
) -> dict[str, Any]:
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    env = claude_env(home, server.url, API_KEY, discovery=discovery)
    done = subprocess.run(
        [claude, "-p", prompt, "--model", model, "--output-format", "json", *extra],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"claude printed nothing (exit {done.returncode}): {done.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    assert result["type"] == "result"
    assert result["is_error"] is False, result
    assert done.returncode == 0, done.stderr[-2000:]
    return result


def decoded(backend: ScriptedChatModel, prompt_ids: Sequence[int]) -> str:
    return backend.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def test_text_reply_with_thinking(claude: str, tmp_path: Path) -> None:
    backend = ScriptedChatModel(
        ["<think>The user wants a greeting.</think>Hello from turbospark."],
        model_id="local",
        max_context=MAX_CONTEXT,
    )
    with LiveServer([backend], api_keys=[API_KEY]) as server:
        result = run_claude(claude, server, tmp_path, "say hello", "local")
    assert result["result"] == "Hello from turbospark."
    assert backend.prompts, "Claude Code never reached the backend"
    for prompt_ids in backend.prompts:
        text = decoded(backend, prompt_ids)
        assert "x-anthropic-billing-header" not in text  # the per-request attribution is dropped
        assert "<|im_start|>user\n" in text and "say hello" in text


TOOL_REPLY = (
    "<think>I will run the marker command.</think>"
    '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo tool\\"-\\"ran", '
    '"description": "Print a marker"}}\n</tool_call>'
)
FINAL_REPLY = "The command printed tool-ran."
# The shell strips the quotes, so this output can only come from actually running the command.
TOOL_OUTPUT = "<tool_response>\ntool-ran\n</tool_response>"


class RoundTripModel(ScriptedChatModel):
    """Asks for the Bash tool until a tool result comes back, then answers.

    Chosen by prompt rather than by turn, so extra requests Claude Code may send (a title, a
    topic check) cannot shift the script.
    """

    def __init__(self) -> None:
        super().__init__([FINAL_REPLY], model_id="local", max_context=MAX_CONTEXT)
        self.asker = ScriptedChatModel([TOOL_REPLY], model_id="local", max_context=MAX_CONTEXT)
        self.log: list[tuple[str, str]] = []  # (which reply, rendered prompt), in arrival order
        self.log_lock = threading.Lock()

    def run_completion(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        images: Sequence[RequestImage] | None,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        text = decoded(self, prompt_ids)
        wants_tool = "<tools>" in text and "<tool_response>" not in text
        with self.log_lock:
            self.log.append(("tool" if wants_tool else "final", text))
        if wants_tool:
            return self.asker.run_completion(prompt_ids, config, images, cancel, on_progress)
        return super().run_completion(prompt_ids, config, images, cancel, on_progress)


def test_tool_round_trip(claude: str, tmp_path: Path) -> None:
    backend = RoundTripModel()
    with LiveServer([backend], api_keys=[API_KEY]) as server:
        result = run_claude(
            claude,
            server,
            tmp_path,
            "Run the marker command and tell me what it printed.",
            "claude-turbospark-local",
            "--allowedTools",
            "Bash(echo:*)",
        )
    assert result["result"] == FINAL_REPLY
    kinds = [kind for kind, _ in backend.log]
    assert "tool" in kinds and "final" in kinds[kinds.index("tool") + 1 :], kinds
    follow_up = next(text for kind, text in backend.log if kind == "final" and TOOL_OUTPUT in text)
    # The follow-up carried the assistant's tool_use (with its thinking) and the tool_result.
    assert '<tool_call>\n{"name": "Bash", "arguments": {"command": "echo tool\\"-\\"ran"' in follow_up
    assert "<think>\nI will run the marker command.\n</think>" in follow_up
    assert follow_up.index("<tool_call>") < follow_up.index(TOOL_OUTPUT)


def test_gateway_discovery_caches_the_claude_aliases(claude: str, tmp_path: Path) -> None:
    backends = [
        ScriptedChatModel(["Hi."], model_id="local", max_context=MAX_CONTEXT),
        ScriptedChatModel(["Hi."], model_id="other", max_context=MAX_CONTEXT),
    ]
    with LiveServer(backends, api_keys=[API_KEY]) as server:
        result = run_claude(claude, server, tmp_path, "say hi", "local", discovery=True)
    assert result["result"] == "Hi."
    cache = json.loads((tmp_path / "home" / ".claude" / "cache" / "gateway-models.json").read_text())
    assert cache["baseUrl"] == server.url
    assert [m["id"] for m in cache["models"]] == ["claude-turbospark-local", "claude-turbospark-other"]
