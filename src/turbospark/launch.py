"""`turbospark launch claude|codex [--model M] [-- ARGS]`: one command to run an agent on a local model.

1. The agent's CLI must be on PATH; a missing one is a clear message saying how to install it.
2. A server answering at --host/--port is used as it is; else one is started (`serve --model M
   --disk-cache-gb 8`, its log under the cache directory) and stopped when the agent exits. The
   disk prefix cache makes the next launch's first turn a read of the agent's prompt instead of
   minutes of prefill on a CPU.
3. The model: --model, else the smallest model of the store whose own context (read from the
   file: GGUF `<arch>.context_length`, config.json `max_position_embeddings`) holds the agent's
   prompt (`AGENT_PROMPT_TOKENS`: Claude Code's first request renders to ~18,800 tokens).
4. Claude Code's environment: the server's URL and a key, every model tier mapped to the local
   model, telemetry, error reports, auto-update, non-essential traffic and the attribution
   header (which changes every request and would defeat the prefix cache) off, and a stream idle
   limit long enough for a first turn on a CPU.
5. Codex's configuration, as `-c` overrides on its command line (the user's own config.toml is
   left as it is): a `turbospark` provider on the server's Responses API with the key in
   `TURBOSPARK_API_KEY`, the model, the same long stream idle limit, analytics, feedback and the
   update check off; and the model's context as served (`/api/ps`, else what its files declare)
   as Codex's context window, with auto-compaction at 80% of it: Codex knows nothing of a local
   model and would otherwise assume a hosted model's window and send a history the server must
   refuse as too long.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from turbospark.registry import CLAUDE_CODE_ALIAS_PREFIX
from turbospark.store import ModelStore, StoreEntry

log = logging.getLogger("turbospark.launch")

# Claude Code's first request (system prompt and ~25 tools) with Qwen2.5's tokenizer, plus room
# for a reply: a model must hold this much context to run it. Codex's first request is smaller
# (instructions and about nine tools, ~38k bytes); the same bound holds it.
AGENT_PROMPT_TOKENS = 18_800
AGENT_MIN_CONTEXT = AGENT_PROMPT_TOKENS + 4_096
AGENTS = ("claude", "codex")
DEFAULT_DISK_CACHE_GB = 8.0
DISK_CACHE_ARGS = ("--disk-cache-gb", f"{DEFAULT_DISK_CACHE_GB:g}")  # for the server launch starts
# a first turn prefills thousands of tokens: on a CPU that can take longer than the agents'
# 300 s default stream idle limit
STREAM_IDLE_MS = 1_800_000

INSTALL_HINTS = {
    "claude": "npm install -g @anthropic-ai/claude-code",
    "codex": "npm install -g @openai/codex",
}


class LaunchError(RuntimeError):
    """Why the agent could not be started; the message says what to do."""


def agent_env(agent: str, base_url: str, model: str, api_key: str) -> dict[str, str]:
    """What the agent's process gets on top of the caller's environment."""
    if agent not in AGENTS:
        raise LaunchError(f"unknown agent {agent!r}; turbospark launch knows: {', '.join(AGENTS)}")
    if agent == "codex":
        return {"TURBOSPARK_API_KEY": api_key}
    alias = model if model.startswith(CLAUDE_CODE_ALIAS_PREFIX) else CLAUDE_CODE_ALIAS_PREFIX + model
    env = {
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
        "ANTHROPIC_MODEL": alias,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": alias,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": alias,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": alias,
        "ANTHROPIC_SMALL_FAST_MODEL": alias,
        "CLAUDE_CODE_SUBAGENT_MODEL": alias,
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    }
    env["CLAUDE_STREAM_IDLE_TIMEOUT_MS"] = os.environ.get(
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS", str(STREAM_IDLE_MS)
    )
    return env


# Codex compacts its history once a request reaches this share of the context window
COMPACT_AT = 0.8


def agent_command(
    agent: str, executable: str, base_url: str, model: str, env: dict[str, str], context: int = 0
) -> list[str]:
    """The agent's argv before the user's own arguments; `context`: the model's context window
    as served (0: unknown, the agent's own default)."""
    if agent == "claude":
        return [executable, "--model", env["ANTHROPIC_MODEL"]]
    provider = (
        f'{{name = "turbospark", base_url = "{base_url}/v1", wire_api = "responses", '
        f'env_key = "TURBOSPARK_API_KEY", stream_idle_timeout_ms = {STREAM_IDLE_MS}}}'
    )
    overrides = [
        f"model={json.dumps(model)}",
        'model_provider="turbospark"',
        f"model_providers.turbospark={provider}",
        "analytics.enabled=false",
        "feedback.enabled=false",
        "check_for_update_on_startup=false",
        # plugins: at start Codex clones github.com/openai/plugins and asks api.github.com; a
        # local model needs neither, and a machine offline would wait on them
        "features.plugins=false",
        "features.remote_plugin=false",
    ]
    if context > 0:
        overrides += [
            f"model_context_window={context}",
            f"model_auto_compact_token_limit={int(context * COMPACT_AT)}",
        ]
    return [executable, *(a for o in overrides for a in ("-c", o))]


def model_context(entry: StoreEntry) -> int:
    """The context the model's files declare (0 where they say nothing)."""
    path = entry.path
    if path is None:
        return 0
    try:
        if entry.format == "gguf":
            from turbospark.engine.gguf_file import GGUFFile

            gguf = path if path.is_file() else next(path.glob("*.gguf"))
            meta = GGUFFile(gguf).metadata
            arch = meta.get("general.architecture", "")
            return int(meta.get(f"{arch}.context_length", 0))
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return int(config.get("max_position_embeddings", 0))
    except (OSError, ValueError, StopIteration, KeyError):
        return 0


def pick_model(store: ModelStore) -> str:
    """The smallest completion model whose context holds the agent's prompt."""
    fits = [e for e in store.entries() if "completion" in e.kinds and model_context(e) >= AGENT_MIN_CONTEXT]
    if not fits:
        pullable = ", ".join(store.pullable()) or "none"
        raise LaunchError(
            f"no model here holds Claude Code's ~{AGENT_PROMPT_TOKENS}-token prompt (a context of at "
            f"least {AGENT_MIN_CONTEXT} is needed); pull one (`turbospark pull qwen2.5-coder:0.5b`; "
            f"pullable: {pullable}) or name one with --model"
        )
    return min(fits, key=lambda e: e.size).name


def served_context(base_url: str, model: str, model_dirs: Sequence[str], api_key: str) -> int:
    """The model's context as the server at base_url serves it (its `/api/ps` entry, once the
    model is loaded), else as its files declare it; 0 where neither says."""
    names = {model, model + ":latest", model.removesuffix(":latest")}
    try:
        ask = urllib.request.Request(base_url + "/api/ps", headers={"Authorization": f"Bearer {api_key}"})
        with urllib.request.urlopen(ask, timeout=5) as reply:
            for loaded in json.loads(reply.read()).get("models", []):
                if {loaded.get("name"), loaded.get("model")} & names and loaded.get("context_length"):
                    return int(loaded["context_length"])
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        pass
    entry = ModelStore(model_dirs).find(model)
    return 0 if entry is None else model_context(entry)


def answers(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/api/version", timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(base_url: str, server: subprocess.Popen[bytes], log_path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise LaunchError(f"the server exited with {server.returncode}; its log: {log_path}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise LaunchError(f"the server did not become ready in {timeout:.0f} s; its log: {log_path}")


def start_server(
    host: str, port: int, model: str, extra: Sequence[str]
) -> tuple[subprocess.Popen[bytes], Path]:
    from turbospark.engine.checkpoint import cache_dir

    log_path = cache_dir() / "logs" / f"launch-serve-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "turbospark", "serve", "--host", host, "--port", str(port)]
    command += ["--model", model, *extra]
    with open(log_path, "ab") as out:
        server = subprocess.Popen(
            command, stdout=out, stderr=out, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
    return server, log_path


PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the server's child process: SIGTERM it when launch dies, even killed outright (a
    launch ended with SIGKILL otherwise left its server running). Linux only; elsewhere the
    server is stopped by launch's own exit path alone."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def launch(
    agent: str,
    *,
    model: str | None,
    host: str,
    port: int,
    agent_args: Sequence[str],
    serve_args: Sequence[str] = (),
    model_dirs: Sequence[str] = (),
    ready_timeout: float = 900.0,
) -> int:
    executable = shutil.which(agent)
    if executable is None:
        hint = INSTALL_HINTS.get(agent, "")
        raise LaunchError(
            f"the {agent!r} command is not on PATH: install it first" + (f" ({hint})" if hint else "")
        )
    base_url = f"http://{host}:{port}"
    chosen = model or pick_model(ModelStore(model_dirs))
    api_key = os.environ.get("TURBOSPARK_API_KEY", "").strip() or "turbospark"
    env = {**os.environ, **agent_env(agent, base_url, chosen, api_key)}

    def command() -> list[str]:
        context = served_context(base_url, chosen, model_dirs, api_key) if agent == "codex" else 0
        if context:
            print(f"turbospark: {agent} gets a context window of {context} tokens", file=sys.stderr)
        return [*agent_command(agent, executable, base_url, chosen, env, context), *agent_args]

    if answers(base_url):
        print(f"turbospark: {agent} on {chosen} at {base_url}", file=sys.stderr)
        os.execve(executable, command(), env)
    dirs = [a for d in model_dirs for a in ("--model-dir", d)]
    server, log_path = start_server(host, port, chosen, [*dirs, *DISK_CACHE_ARGS, *serve_args])
    print(f"turbospark: started a server for {chosen} at {base_url} (log: {log_path})", file=sys.stderr)
    try:
        wait_healthy(base_url, server, log_path, ready_timeout)
        print(f"turbospark: {agent} on {chosen}", file=sys.stderr)
        return subprocess.call(command(), env=env)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
