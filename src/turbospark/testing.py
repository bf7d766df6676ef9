"""Running a real server on loopback inside a test process.

`LiveServer` starts uvicorn on 127.0.0.1 with a free port in a background thread and stops it
on exit. Tests drive it with the real client libraries (openai, anthropic, ollama) exactly as a
user would, over HTTP.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from types import TracebackType

import uvicorn

from turbospark.api.common import ServerState
from turbospark.backend import ChatModel
from turbospark.registry import ModelRegistry
from turbospark.server import create_app


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class LiveServer:
    def __init__(
        self,
        backends: Sequence[ChatModel] | None = None,
        *,
        state: ServerState | None = None,
        api_keys: Sequence[str] = (),
    ) -> None:
        if state is None:
            registry = ModelRegistry()
            for backend in backends or []:
                registry.add(backend)
            state = ServerState(registry=registry, api_keys=frozenset(api_keys))
        self.state = state
        self.port = free_port()
        config = uvicorn.Config(
            create_app(state), host="127.0.0.1", port=self.port, log_level="warning", access_log=False
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
