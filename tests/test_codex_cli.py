"""The real Codex CLI (`codex exec`), headless, against a loopback server on the scripted backend.

Codex speaks only the Responses API. Each run gets a throwaway CODEX_HOME whose config.toml
points a `model_providers` entry at the server (`wire_api = "responses"`, a dummy key through
`env_key`) and turns off the update check, analytics and feedback; `--strict-config` makes a
misspelt key fail the run instead of being ignored. Commands run with `-s danger-full-access`
(exec never asks for approval), inside the test's temporary folder.

What Codex 0.169.0 sends, as recorded by these tests: one `POST /v1/responses` per model turn,
`stream: true`, `store: false`, the whole history in `input` (developer and user messages, then
`function_call` / `function_call_output` items), `include: ["reasoning.encrypted_content"]`,
`reasoning.summary: "auto"`, `prompt_cache_key`, `client_metadata`, and about nine tools:
`function` tools (`exec_command`, `write_stdin`, ...), a `namespace` tool (`multi_agent_v1`,
five functions) and a hosted `web_search` tool.

These tests skip only when `codex` is not on PATH and TURBOSPARK_REQUIRE_CODEX is unset; CI
installs the CLI (`make codex`) and sets that variable, so there they always run.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from turbospark.backend import CancelFlag, CompletionResult, GenerationConfig, ProgressCallback, RequestImage
from turbospark.scripted import ScriptedChatModel
from turbospark.testing import LiveServer, ServerProcess

pytestmark = pytest.mark.codex

API_KEY = "turbospark-test-key"
# Codex's instructions and tool schemas come to ~38k bytes; the scripted tokenizer spends one
# token per byte, and a second turn resends it all.
MAX_CONTEXT = 262144


class RecordingServer(LiveServer):
    """A LiveServer that keeps the JSON body of every POST to /v1/responses, in arrival order."""

    def __init__(self, backends: Sequence[ScriptedChatModel], **kwargs: Any) -> None:
        super().__init__(backends, **kwargs)
        self.bodies: list[dict[str, Any]] = []
        app = self.server.config.app

        async def recorder(scope: Any, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] != "/v1/responses":
                await app(scope, receive, send)
                return
            chunks: list[bytes] = []
            more = True
            while more:
                message = await receive()
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
            self.bodies.append(json.loads(b"".join(chunks)))
            replayed = False

            async def replay() -> Any:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                return await receive()

            await app(scope, replay, send)

        self.server.config.app = recorder


def codex_home(root: Path, base_url: str, model: str = "local", idle_ms: int | None = None) -> Path:
    home = root / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        f"""model = "{model}"
model_provider = "turbospark"
check_for_update_on_startup = false

[analytics]
enabled = false

[feedback]
enabled = false

[features]
plugins = false
remote_plugin = false

[model_providers.turbospark]
name = "turbospark"
base_url = "{base_url}/v1"
wire_api = "responses"
env_key = "TURBOSPARK_API_KEY"
"""
        + (f"stream_idle_timeout_ms = {idle_ms}\n" if idle_ms is not None else ""),
        encoding="utf-8",
    )
    return home


def run_codex(
    codex: str,
    server: LiveServer | ServerProcess,
    tmp_path: Path,
    prompt: str,
    *,
    model: str = "local",
    timeout: float = 120,
) -> list[dict[str, Any]]:
    """`codex exec --json PROMPT`; returns its JSONL events, after checking the run succeeded."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    idle_ms = int(timeout * 1000) if timeout > 300 else None  # Codex's own limit is 300 s
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "CODEX_HOME": str(codex_home(tmp_path, server.url, model, idle_ms)),
        "TURBOSPARK_API_KEY": API_KEY,
    }
    done = subprocess.run(
        [
            codex,
            "exec",
            "--json",
            "--strict-config",
            "--skip-git-repo-check",
            "-s",
            "danger-full-access",
            prompt,
        ],
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return completed(done)


def launch_codex(
    server: LiveServer | ServerProcess, tmp_path: Path, prompt: str, *, model: str, timeout: float = 120
) -> tuple[list[dict[str, Any]], str]:
    """`turbospark launch codex --model MODEL -- exec --json ... PROMPT` against the running
    `server`, in tmp_path/work with tmp_path as HOME (no Codex config written beforehand);
    returns Codex's JSONL events and launch's stderr, after checking the run succeeded."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    launch = [sys.executable, "-m", "turbospark", "launch", "codex", "--model", model]
    agent = ["exec", "--json", "--skip-git-repo-check", "-s", "danger-full-access", prompt]
    log = server.log if isinstance(server, ServerProcess) else lambda: ""
    doing = server.what_it_does if isinstance(server, ServerProcess) else lambda: ""
    try:
        done = subprocess.run(
            [*launch, "--port", str(server.port), "--", *agent],
            cwd=work,
            env={
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src"),
                "HOME": str(tmp_path),
                "TURBOSPARK_API_KEY": API_KEY,
            },
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as late:  # say what the server was doing meanwhile
        shown = (late.stdout or b"")[-3000:]
        pytest.fail(
            f"codex ran past {timeout:.0f} s; its output: {shown!r}\nwhat the server was doing:\n{doing()}"
        )
    return completed(done, log()[-3000:]), done.stderr


def completed(done: subprocess.CompletedProcess[str], server_log: str = "") -> list[dict[str, Any]]:
    """A Codex run's JSONL events, once its exit status and last event say the turn completed."""
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0, (
        f"codex exited {done.returncode}: {done.stdout[-3000:]}\n{done.stderr[-3000:]}\n{server_log}"
    )
    assert events and events[-1]["type"] == "turn.completed", (events, server_log)
    return events


def items(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e["item"] for e in events if e["type"] == "item.completed" and e["item"]["type"] == kind]


def decoded(backend: ScriptedChatModel, prompt_ids: Sequence[int]) -> str:
    return backend.tokenizer.decode(prompt_ids, skip_special_tokens=False)


def test_text_turn_with_codex_tools(codex: str, tmp_path: Path) -> None:
    backend = ScriptedChatModel(
        ["<think>A greeting is enough.</think>Hello from turbospark."],
        model_id="local",
        max_context=MAX_CONTEXT,
    )
    with RecordingServer([backend], api_keys=[API_KEY]) as server:
        events = run_codex(codex, server, tmp_path, "say hi")
    assert [m["text"] for m in items(events, "agent_message")] == ["Hello from turbospark."]
    (body,) = server.bodies
    assert body["stream"] is True and body["model"] == "local"
    kinds = {t["type"] for t in body["tools"]}
    assert {"function", "namespace", "web_search"} <= kinds, kinds
    prompt = decoded(backend, backend.prompts[-1])
    # The namespace's functions reach the model under their flat names; the hosted tool does not.
    namespace = next(t for t in body["tools"] if t["type"] == "namespace")
    for tool in namespace["tools"]:
        assert f'"name": "{namespace["name"]}__{tool["name"]}"' in prompt
    assert '"name": "exec_command"' in prompt and "web_search" not in prompt
    assert "say hi" in prompt


SHELL_CALL = (
    '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo tool\\"-\\"ran"}}\n</tool_call>'
)
FINAL_REPLY = "The command printed tool-ran."


class ToolThenAnswer(ScriptedChatModel):
    """Calls `call` until a tool result is in the prompt, then answers: chosen by prompt, not by
    turn, so an extra request Codex may send cannot shift the script."""

    def __init__(self, call: str) -> None:
        super().__init__([FINAL_REPLY], model_id="local", max_context=MAX_CONTEXT)
        self.asker = ScriptedChatModel([call], model_id="local", max_context=MAX_CONTEXT)
        self.log: list[tuple[str, str]] = []
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
        wants_tool = "<tool_response>" not in text
        with self.log_lock:
            self.log.append(("tool" if wants_tool else "final", text))
        if wants_tool:
            return self.asker.run_completion(prompt_ids, config, images, cancel, on_progress)
        return super().run_completion(prompt_ids, config, images, cancel, on_progress)


def test_shell_tool_round_trip(codex: str, tmp_path: Path) -> None:
    backend = ToolThenAnswer(SHELL_CALL)
    with RecordingServer([backend], api_keys=[API_KEY]) as server:
        events = run_codex(codex, server, tmp_path, "Run the marker command and tell me what it printed.")
    (command,) = items(events, "command_execution")
    # The shell strips the quotes: this output can only come from actually running the command.
    assert command["exit_code"] == 0 and command["aggregated_output"] == "tool-ran\n"
    assert [m["text"] for m in items(events, "agent_message")] == [FINAL_REPLY]
    first, second = server.bodies
    assert not any(i.get("type") == "function_call" for i in first["input"])
    # The follow-up carries the call as Codex read it from the stream, and the command's output.
    call = next(i for i in second["input"] if i.get("type") == "function_call")
    assert call["name"] == "exec_command" and json.loads(call["arguments"]) == {"cmd": 'echo tool"-"ran'}
    output = next(i for i in second["input"] if i.get("type") == "function_call_output")
    assert output["call_id"] == call["call_id"] and "tool-ran" in str(output["output"])
    follow_up = next(text for kind, text in backend.log if kind == "final")
    assert '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo tool\\"-\\"ran"}}' in follow_up
    response = follow_up.index("<tool_response>")
    assert follow_up.index("<tool_call>") < response < follow_up.index("tool-ran\n", response)


NAMESPACED_CALL = (
    '<tool_call>\n{"name": "multi_agent_v1__close_agent", "arguments": {"target": "no-such-agent"}}'
    "\n</tool_call>"
)


def test_namespaced_call_reaches_codex_under_its_own_name(codex: str, tmp_path: Path) -> None:
    backend = ToolThenAnswer(NAMESPACED_CALL)
    with RecordingServer([backend], api_keys=[API_KEY]) as server:
        events = run_codex(codex, server, tmp_path, "Close the helper agent.")
    assert [m["text"] for m in items(events, "agent_message")] == [FINAL_REPLY]
    second = server.bodies[-1]
    call = next(i for i in second["input"] if i.get("type") == "function_call")
    # Codex dispatched the call to its namespace's tool and sends it back split, as it declared it.
    assert (call.get("namespace"), call["name"]) == ("multi_agent_v1", "close_agent"), call
    output = next(i for i in second["input"] if i.get("type") == "function_call_output")
    assert output["call_id"] == call["call_id"]
    assert "unsupported call" not in str(output["output"]).lower(), output
    follow_up = next(text for kind, text in backend.log if kind == "final")
    assert '"name": "multi_agent_v1__close_agent"' in follow_up


def test_launch_codex_runs_a_turn_on_the_running_server(codex: str, tmp_path: Path) -> None:
    """`turbospark launch codex`: Codex reaches the server through the `-c` overrides alone (no
    config.toml is written), with the key launch hands it."""
    backend = ScriptedChatModel(["Hello through launch."], model_id="local", max_context=MAX_CONTEXT)
    with RecordingServer([backend], api_keys=[API_KEY]) as server:
        events, stderr = launch_codex(server, tmp_path, "say hi", model="local")
    assert f"codex on local at {server.url}" in stderr
    # the scripted model's context, read from the server's /api/ps, is Codex's window
    assert f"codex gets a context window of {MAX_CONTEXT} tokens" in stderr
    assert [m["text"] for m in items(events, "agent_message")] == ["Hello through launch."]
    (body,) = server.bodies
    assert body["model"] == "local" and body["stream"] is True
    assert not (tmp_path / ".codex" / "config.toml").exists()
