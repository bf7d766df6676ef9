"""Model registry: a request's model id (or alias) to the served model that answers it.

A `ServedModel` is a backend plus the server's policy for it (tool-call guardrails, the default
system prompt, the default reasoning effort, the sampler settings a request that leaves them
unset gets), fixed when the server builds it; the backend itself only knows model facts and how
to run a completion. `turbospark.plan` is the one reader of the policy.

An exact id or alias routes; Ollama-style names also resolve with their `:latest` tag dropped.
Every model that generates is also served as `claude-turbospark-<id>`: Claude Code's gateway
discovery keeps only model ids that start with "claude" or "anthropic"; an embedding model gets
no such alias, or Claude Code would offer it as a chat model. An unknown id is a 404 in the
caller's envelope unless a fallback model was configured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from turbospark.backend import BUILTIN_SAMPLING, ChatModel, ReasoningEffort, SamplingDefaults
from turbospark.errors import ApiError, ErrorKind
from turbospark.limits import Limits
from turbospark.toolcalls.guardrails import GuardrailConfig

CLAUDE_CODE_ALIAS_PREFIX = "claude-turbospark-"


def model_kinds(backend: ChatModel) -> list[str]:
    """What a model serves, for the model listings: "completion" and/or "embedding". A backend
    may declare it (`capabilities`, as the embedding backend does); else it follows the protocol."""
    declared = getattr(backend, "capabilities", None)
    if declared is not None:
        return list(declared)
    kinds = ["completion", "embedding"] if backend.supports_embeddings() else ["completion"]
    return [*kinds, "vision"] if backend.vision() is not None else kinds


@dataclass(slots=True)
class ServedModel:
    """A backend as this server serves it: the model plus the server's policy for it."""

    backend: ChatModel
    guardrails: GuardrailConfig = field(default_factory=GuardrailConfig)
    default_system: str | None = None  # used only when a request has no system/developer message
    default_reasoning: ReasoningEffort = ReasoningEffort.OFF
    # Every sampler setting a request leaves unset takes its value from here. None (the default):
    # the model's own recommendation (generation_config.json, GGUF general.sampling.*) where it
    # gives one, else `BUILTIN_SAMPLING`; `NO_SAMPLING_DEFAULTS` gives plain temperature sampling.
    sampling: SamplingDefaults | None = None

    def __post_init__(self) -> None:
        if self.sampling is None:
            self.sampling = self.backend.sampling_defaults().over(BUILTIN_SAMPLING)

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """`sampling`, resolved (every field set)."""
        assert self.sampling is not None  # set by __post_init__
        return self.sampling

    @property
    def model_id(self) -> str:
        return self.backend.model_id

    def names(self) -> list[str]:
        """The id, the backend's own aliases, then the Claude Code alias (see the docstring).
        A model that cannot generate (an embedding encoder) gets no Claude Code alias: Claude
        Code would offer it as a chat model."""
        names = [self.backend.model_id, *self.backend.aliases()]
        if "completion" not in model_kinds(self.backend):
            return names
        claude = CLAUDE_CODE_ALIAS_PREFIX + self.backend.model_id
        return names if claude in names else [*names, claude]


class ModelRegistry:
    def __init__(self, fallback: str | None = None, limits: Limits | None = None) -> None:
        self._served: list[ServedModel] = []
        self.limits = limits or Limits()  # per-request bounds, checked in plan.py
        self._by_name: dict[str, ServedModel] = {}
        self.fallback = fallback
        self.num_loading = 0  # models announced but not loaded yet: /health answers 503
        self.created = int(time.time())

    def add(self, model: ChatModel | ServedModel) -> ServedModel:
        """Serves `model`; a bare backend is served with the default policy."""
        served = model if isinstance(model, ServedModel) else ServedModel(model)
        names = served.names()
        for name in names:
            if name in self._by_name:
                raise ValueError(f"model id {name!r} is served twice")
        self._served.append(served)
        for name in names:
            self._by_name[name] = served
        return served

    def served(self) -> list[ServedModel]:
        return list(self._served)

    def backends(self) -> list[ChatModel]:
        return [s.backend for s in self._served]

    def lookup(self, name: str) -> ServedModel | None:
        found = self._by_name.get(name)
        if found is None and name.endswith(":latest"):
            found = self._by_name.get(name[: -len(":latest")])
        return found

    def resolve(self, name: str) -> ServedModel:
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
            known = ", ".join(sorted(s.model_id for s in self._served)) or "none loaded"
            raise ApiError(
                ErrorKind.NOT_FOUND, f"model {name!r} not found; this server serves: {known}", param="model"
            )
        return found
