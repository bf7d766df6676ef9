"""Model registry: a request's model id (or alias) to the backend that serves it.

An exact id or alias routes; Ollama-style names also resolve with their `:latest` tag dropped.
An unknown id is a 404 in the caller's envelope unless a fallback model was configured.
"""

from __future__ import annotations

import time

from turbospark.backend import ChatModel
from turbospark.errors import ApiError, ErrorKind
from turbospark.limits import Limits


class ModelRegistry:
    def __init__(self, fallback: str | None = None, limits: Limits | None = None) -> None:
        self._backends: list[ChatModel] = []
        self.limits = limits or Limits()  # per-request bounds, checked in plan.py
        self._by_name: dict[str, ChatModel] = {}
        self.fallback = fallback
        self.num_loading = 0  # models announced but not loaded yet: /health answers 503
        self.created = int(time.time())

    def add(self, backend: ChatModel) -> None:
        names = [backend.model_id, *backend.aliases()]
        for name in names:
            if name in self._by_name:
                raise ValueError(f"model id {name!r} is served twice")
        self._backends.append(backend)
        for name in names:
            self._by_name[name] = backend

    def backends(self) -> list[ChatModel]:
        return list(self._backends)

    def lookup(self, name: str) -> ChatModel | None:
        found = self._by_name.get(name)
        if found is None and name.endswith(":latest"):
            found = self._by_name.get(name[: -len(":latest")])
        return found

    def resolve(self, name: str) -> ChatModel:
        found = self.lookup(name)
        if found is None and self.fallback is not None:
            found = self.lookup(self.fallback)
        if found is None and self.num_loading:
            raise ApiError(
                ErrorKind.UNAVAILABLE,
                f"model {name!r} is not loaded yet: {self.num_loading} model(s) still loading; retry shortly",
                param="model",
                retry_after=2.0,
            )
        if found is None:
            known = ", ".join(sorted(b.model_id for b in self._backends)) or "none loaded"
            raise ApiError(
                ErrorKind.NOT_FOUND, f"model {name!r} not found; this server serves: {known}", param="model"
            )
        return found
