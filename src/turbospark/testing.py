"""Running a real server on loopback inside a test process.

`LiveServer` starts uvicorn on 127.0.0.1 with a free port in a background thread and stops it
on exit. Tests drive it with the real client libraries (openai, anthropic, ollama) exactly as a
user would, over HTTP. `ServerProcess` runs `turbospark serve` as a subprocess instead, for what
only a whole process shows (signals, exit status, start-up failures, the server's log).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import uvicorn

from turbospark.api.common import ServerState
from turbospark.backend import Backend
from turbospark.registry import ModelRegistry
from turbospark.server import create_app

# the /metrics series that say what a server is busy with
IN_FLIGHT_METRICS = re.compile(
    r"turbospark_(running_sequences|waiting_sequences|engine_steps_total|forward_tokens_total|"
    r"generation_tokens_total|prompt_tokens_total|requests_total|kv_blocks_used)\b"
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LiveServer:
    def __init__(
        self,
        backends: Sequence[Backend] | None = None,
        *,
        state: ServerState | None = None,
        api_keys: Sequence[str] = (),
        cors_origins: Sequence[str] = (),
    ) -> None:
        if state is None:
            registry = ModelRegistry()
            for backend in backends or []:
                registry.add(backend)
            state = ServerState(registry=registry, api_keys=frozenset(api_keys))
        self.state = state
        self.port = free_port()
        config = uvicorn.Config(
            create_app(state, cors_origins=cors_origins),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class ServerProcess:
    """`python -m turbospark serve ARGS` on a free loopback port; its log goes to a temp file."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        # Lives as long as the server does; closed and removed in __exit__.
        self._log = tempfile.NamedTemporaryFile(prefix="turbospark-serve-", suffix=".log", delete=False)  # noqa: SIM115
        src = str(Path(__file__).resolve().parent.parent)
        cmd = [sys.executable, "-m", "turbospark", "serve", "--port", str(self.port), *args]
        base = {"PYTHONPATH": src, "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        self.proc = subprocess.Popen(cmd, env={**base, **(env or {})}, stdout=self._log, stderr=self._log)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return Path(self._log.name).read_text(encoding="utf-8", errors="replace")

    def what_it_does(self, tail: int = 8000) -> str:
        """For a test that waited too long: the server's metrics of work in flight, then (after
        SIGUSR1, which `serve` answers by printing every thread's stack) the end of its log."""
        lines = []
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=5) as reply:
                text = reply.read().decode()
            lines = [line for line in text.splitlines() if IN_FLIGHT_METRICS.match(line)]
        except OSError as exc:
            lines = [f"/metrics: {exc}"]
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
        return "\n".join(lines) + "\nthe server log:\n" + self.log()[-tail:]

    def wait_healthy(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server never became healthy:\n{self.log()}")

    def terminate(self, timeout: float = 60.0) -> int:
        """Sends SIGTERM and returns the exit status (negative: ended by a signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def __enter__(self) -> ServerProcess:
        try:
            self.wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._log.close()
        os.unlink(self._log.name)


def claude_env(home: Path, base_url: str, api_key: str, *, discovery: bool = False) -> dict[str, str]:
    """The environment for a headless Claude Code run against `base_url`: a throwaway HOME,
    telemetry, auto-update and error reports off, and the non-streaming fallback off (so a broken
    stream fails the run instead of being retried without streaming). Non-essential traffic is
    off too, unless `discovery` (the gateway's model discovery needs it; telemetry stays off)."""
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(home),
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "CLAUDE_CODE_DISABLE_NONSTREAMING_FALLBACK": "1",
        "ANTHROPIC_BASE_URL": base_url,
        "ANTHROPIC_API_KEY": api_key,
    }
    if discovery:
        env["CLAUDE_CODE_ENABLE_GATEWAY_MODEL_DISCOVERY"] = "1"
    else:
        env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    return env
