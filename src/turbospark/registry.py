"""Model registry: a request's model id (or alias) to the served model that answers it.

A `ServedModel` is a backend plus the server's policy for it (tool-call guardrails, the default
system prompt, the default reasoning effort, the sampler settings a request that leaves them
unset gets), fixed when the server builds it; the backend itself only knows model facts and how
to run a completion or make embeddings (`turbospark.backend`: a `ChatModel` or an `Embedder`).
`turbospark.plan` is the one reader of the policy.

An exact id or alias routes; Ollama-style names also resolve with their `:latest` tag dropped.
Every model that generates is also served as `claude-turbospark-<id>`: Claude Code's gateway
discovery keeps only model ids that start with "claude" or "anthropic"; an embedding model gets
no such alias, or Claude Code would offer it as a chat model. An unknown id is a 404 in the
caller's envelope unless a fallback model was configured.

Models load on demand when the registry has a store and a loader (`serve` gives it both): a
name the store knows but no loaded model answers raises `ModelNotLoaded` from `resolve`; the
API's endpoint wrapper (`api.common.endpoint`) awaits `ensure_loaded` and runs the handler
again. Concurrent first requests for one model share one load (one future per loading name);
a load that fails is an error naming the model and the reason, for that request only. Before
a load, least-recently-used models are unloaded while `max_loaded` would be exceeded: never a
pinned one (`keep_alive` None: `serve --model`, or Ollama's `keep_alive: -1`) and never one in
use (a live `ChatRequest` holds a lease on its model, `lease`; an engine with sequences in its line
counts too); when every loaded model is in use the load waits for one to finish. A model
whose `keep_alive` has run out since its last request ended is unloaded by a reaper thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from turbospark.backend import (
    BUILTIN_SAMPLING,
    Backend,
    ChatModel,
    Embedder,
    ReasoningEffort,
    SamplingDefaults,
)
from turbospark.errors import ApiError, ErrorKind
from turbospark.limits import Limits
from turbospark.toolcalls.guardrails import GuardrailConfig

if TYPE_CHECKING:
    from turbospark.store import ModelStore, StoreEntry

log = logging.getLogger("turbospark.registry")

CLAUDE_CODE_ALIAS_PREFIX = "claude-turbospark-"
DEFAULT_KEEP_ALIVE = 300.0  # Ollama's: five minutes after the last request ends


def model_kinds(backend: Backend) -> list[str]:
    """What a model serves, for the model listings, by its kind: "completion" for a `ChatModel`
    (and "vision" when it has a vision tower), "embedding" for an `Embedder`."""
    kinds: list[str] = []
    if isinstance(backend, ChatModel):
        kinds.append("completion")
    if isinstance(backend, Embedder):
        kinds.append("embedding")
    if isinstance(backend, ChatModel) and backend.vision() is not None:
        kinds.append("vision")
    return kinds


# A model that has written one block of up to 128 tokens over and over for this many tokens is
# stuck, at any temperature: the token that would start the block again is masked, once per
# loop. `serve --loop-guard 0` turns it off.
DEFAULT_LOOP_GUARD = 256


@dataclass(slots=True)
class ServedModel:
    """A backend as this server serves it: the model plus the server's policy for it."""

    backend: Backend
    guardrails: GuardrailConfig = field(default_factory=GuardrailConfig)
    default_system: str | None = None  # used only when a request has no system/developer message
    # appended to the system prompt of a request that declares tools (`serve --tool-prompt`)
    tool_prompt: str | None = None
    # `serve --tool-descriptions brief`: the chat template sees each declared tool's description
    # (and its parameters') cut to a short lead; the grammar and the validation keep the whole schema
    brief_tools: bool = False
    # `serve --tool-focus`: of a request declaring many tools, the model reads and may start calls
    # to only these (`plan.focus_tools`); empty: all
    focus_tools: tuple[str, ...] = ()
    default_reasoning: ReasoningEffort = ReasoningEffort.OFF
    default_seed: int | None = None  # used only when a request sets no seed
    # generated tokens over which an exact loop is broken (`sampling.loop_continuation`); 0: off
    loop_guard: int = DEFAULT_LOOP_GUARD
    # Every sampler setting a request leaves unset takes its value from here. None (the default):
    # the model's own recommendation (generation_config.json, GGUF general.sampling.*) where it
    # gives one, else `BUILTIN_SAMPLING`; `NO_SAMPLING_DEFAULTS` gives plain temperature sampling.
    sampling: SamplingDefaults | None = None
    # On-demand bookkeeping (the registry's; under its lock). `keep_alive`: seconds the model
    # stays loaded after its last request ended; None: until the server stops (pinned).
    keep_alive: float | None = None
    store_name: str | None = None  # the store name it was loaded under, if not its id
    leases: int = 0  # live plans on this model
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if self.sampling is None:
            own = (
                self.backend.sampling_defaults()
                if isinstance(self.backend, ChatModel)
                else SamplingDefaults()
            )
            self.sampling = own.over(BUILTIN_SAMPLING)

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
        if self.store_name and self.store_name not in names:
            names.append(self.store_name)
        if not isinstance(self.backend, ChatModel):
            return names
        claude = CLAUDE_CODE_ALIAS_PREFIX + self.backend.model_id
        return names if claude in names else [*names, claude]


class ModelNotLoaded(Exception):
    """`resolve` found `name` in the store but not loaded: await `registry.ensure_loaded(name)`
    and try again (`api.common.endpoint` does)."""

    def __init__(self, registry: ModelRegistry, name: str) -> None:
        super().__init__(f"model {name!r} is not loaded")
        self.registry = registry
        self.name = name


# builds a served model from a store spec (the CLI's: load_model plus the server's policy)
Loader = Callable[[str], ServedModel]


class ModelRegistry:
    def __init__(
        self,
        fallback: str | None = None,
        limits: Limits | None = None,
        *,
        store: ModelStore | None = None,
        loader: Loader | None = None,
        max_loaded: int | None = None,
        keep_alive: float | None = DEFAULT_KEEP_ALIVE,
        load_wait: float = 600.0,
    ) -> None:
        self._served: list[ServedModel] = []
        self.limits = limits or Limits()  # per-request bounds, checked in plan.py
        self._by_name: dict[str, ServedModel] = {}
        self.fallback = fallback
        self.num_loading = 0  # models announced but not loaded yet: /health answers 503
        self.created = int(time.time())
        self.store = store
        self.loader = loader
        self.max_loaded = max_loaded
        self.keep_alive = keep_alive  # for models loaded on demand; None: until the server stops
        self.load_wait = load_wait  # seconds a load waits for a busy model to free its place
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._loading: dict[str, concurrent.futures.Future[ServedModel]] = {}
        self.num_loads = 0  # loads started (tests check that concurrent requests share one)
        self._reaper: threading.Thread | None = None
        self._closed = False

    # ---- the loaded models
    def add(self, model: Backend | ServedModel) -> ServedModel:
        """Serves `model`; a bare backend is served with the default policy."""
        served = model if isinstance(model, ServedModel) else ServedModel(model)
        with self._lock:
            names = served.names()
            for name in names:
                if name in self._by_name:
                    raise ValueError(f"model id {name!r} is served twice")
            self._served.append(served)
            for name in names:
                self._by_name[name] = served
            self._changed.notify_all()
        return served

    def served(self) -> list[ServedModel]:
        with self._lock:
            return list(self._served)

    def backends(self) -> list[Backend]:
        return [s.backend for s in self.served()]

    def lookup(self, name: str) -> ServedModel | None:
        with self._lock:
            found = self._by_name.get(name)
            if found is None and name.endswith(":latest"):
                found = self._by_name.get(name[: -len(":latest")])
            return found

    def store_entry(self, name: str) -> StoreEntry | None:
        """The store's entry for `name` (Claude Code's alias of it too), loaded or not."""
        if self.store is None:
            return None
        found = self.store.find(name)
        if found is None and name.startswith(CLAUDE_CODE_ALIAS_PREFIX):
            found = self.store.find(name[len(CLAUDE_CODE_ALIAS_PREFIX) :])
        return found

    def _copy_of_loaded(self, name: str) -> ServedModel | None:
        """For a copy's name (`/api/copy`) whose original is loaded: that model, now routed by
        the copy's name too (one load serves every name of a model)."""
        from turbospark.store import base_name

        entry = self.store_entry(name)
        if entry is None or not entry.target:
            return None
        with self._lock:
            found = self.lookup(entry.target)
            if found is not None:
                self._by_name[base_name(name)] = found
            return found

    def loadable(self, name: str) -> bool:
        return self.loader is not None and self.store_entry(name) is not None

    def resolve(self, name: str, holder: object | None = None) -> ServedModel:
        """The served model for `name`; with `holder` (a `ChatRequest`), leased to it
        (`lease`). Raises `ModelNotLoaded` for a name the store can load, else `ApiError`."""
        with self._lock:
            found = self.lookup(name) or self._copy_of_loaded(name)
            if found is not None and holder is not None:
                self.lease(found, holder)
        if found is not None:
            return found
        if found is None and self.loadable(name):
            raise ModelNotLoaded(self, name)
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
            if self.store is not None:
                raise ApiError(ErrorKind.NOT_FOUND, self.store.not_found(name), param="model")
            known = ", ".join(sorted(s.model_id for s in self._served)) or "none loaded"
            raise ApiError(
                ErrorKind.NOT_FOUND, f"model {name!r} not found; this server serves: {known}", param="model"
            )
        if holder is not None:
            self.lease(found, holder)
        return found

    # ---- use: a plan holds its model for as long as it lives
    def lease(self, served: ServedModel, holder: object) -> None:
        """`served` is in use until `holder` (a `ChatRequest`, which its plan and generation
        hold) is garbage: it is not unloaded before."""
        with self._lock:
            served.leases += 1
            served.last_used = time.monotonic()
        weakref.finalize(holder, self._release, served)

    def _release(self, served: ServedModel) -> None:
        with self._lock:
            served.leases -= 1
            served.last_used = time.monotonic()
            self._changed.notify_all()

    def in_use(self, served: ServedModel) -> bool:
        return served.leases > 0 or _engine_busy(served)

    def set_keep_alive(self, served: ServedModel, seconds: float | None) -> None:
        """A request's `keep_alive` (Ollama's: negative pins, 0 unloads once idle); None (the
        request sent none) gives a model loaded on demand the server's default again."""
        with self._lock:
            if seconds is None:
                if served.keep_alive is not None:
                    served.keep_alive = self.keep_alive
            else:
                served.keep_alive = None if seconds < 0 else seconds
            served.last_used = time.monotonic()
            self._changed.notify_all()
        self._start_reaper()

    def expires_at(self, served: ServedModel) -> float | None:
        """Epoch seconds when `served` unloads if no request comes; None: never."""
        with self._lock:
            if served.keep_alive is None:
                return None
            if self.in_use(served):
                return time.time() + served.keep_alive
            return time.time() + max(0.0, served.last_used + served.keep_alive - time.monotonic())

    # ---- loading on demand
    async def ensure_loaded(self, name: str) -> ServedModel:
        """The model `name` loaded (one load shared by every caller); raises `ApiError`."""
        return await asyncio.wrap_future(self.load_future(name))

    def load_future(self, name: str) -> concurrent.futures.Future[ServedModel]:
        from turbospark.store import base_name

        with self._lock:
            done = self.lookup(name)
            if done is not None:
                ready: concurrent.futures.Future[ServedModel] = concurrent.futures.Future()
                ready.set_result(done)
                return ready
            entry = self.store_entry(name)
            if entry is None or self.loader is None:
                raise ApiError(
                    ErrorKind.NOT_FOUND,
                    self.store.not_found(name) if self.store else f"model {name!r} not found",
                    param="model",
                )
            if self._copy_of_loaded(name) is not None:
                return self.load_future(name)
            key = base_name(entry.model)
            future = self._loading.get(key)
            if future is None:
                future = concurrent.futures.Future()
                self._loading[key] = future
                self.num_loads += 1
                threading.Thread(
                    target=self._load, args=(key, entry.spec, future), name=f"load-{key}", daemon=True
                ).start()
            return future

    def load_pinned(self, spec: str) -> ServedModel:
        """Loads a --model at start, pinned (never unloaded). It takes the same place in the
        table of loads in flight as a load on demand, so a request that names the model while
        it loads waits for this load instead of starting a second one of the same weights."""
        from turbospark.store import base_name

        assert self.loader is not None
        entry = self.store_entry(spec) or self._entry_loading(spec)
        key = base_name(entry.model) if entry is not None else None
        mine: concurrent.futures.Future[ServedModel] = concurrent.futures.Future()
        with self._lock:
            theirs = self._loading.get(key) if key is not None else None
            if key is not None and theirs is None:
                self._loading[key] = mine
        if theirs is not None:  # a request got here first: share its load, then pin it
            served = theirs.result()
            with self._lock:
                served.keep_alive = None
            return served
        try:
            served = self.add(self.loader(spec))  # keep_alive None: pinned
        except BaseException as exc:
            mine.set_exception(exc)
            raise
        else:
            mine.set_result(served)
            return served
        finally:
            with self._lock:
                if key is not None and self._loading.get(key) is mine:
                    del self._loading[key]

    def _entry_loading(self, spec: str) -> StoreEntry | None:
        """The store's entry that loads `spec`, a file or folder given by path (--model PATH)."""
        if self.store is None or not Path(spec).exists():
            return None
        where = Path(spec).resolve()
        for entry in self.store.entries():
            if entry.spec == spec or (entry.path is not None and entry.path.resolve() == where):
                return entry
        return None

    def _load(self, key: str, spec: str, future: concurrent.futures.Future[ServedModel]) -> None:
        assert self.loader is not None
        try:
            self._make_room(key)
            log.info("loading %s (%s)", key, spec)
            started = time.perf_counter()
            try:
                served = self.loader(spec)
            except ApiError:
                raise
            except Exception as exc:
                text = str(exc)
                if not text.startswith("cannot load model"):
                    text = f"cannot load model {key!r}: {type(exc).__name__}: {text}"
                log.warning("%s", text)
                raise ApiError(ErrorKind.INTERNAL, text, param="model") from exc
            if served.model_id != key:
                served.store_name = key
            if served.keep_alive is None:
                served.keep_alive = self.keep_alive
            self.add(served)
            log.info("loaded %s in %.1f s", key, time.perf_counter() - started)
            self._start_reaper()
            future.set_result(served)
        except BaseException as exc:
            future.set_exception(exc)
        finally:
            with self._lock:
                self._loading.pop(key, None)

    def _make_room(self, key: str) -> None:
        """Unloads least-recently-used idle models until one more fits under `max_loaded`."""
        if self.max_loaded is None:
            return
        deadline = time.monotonic() + self.load_wait
        detached: list[ServedModel] = []
        try:
            self._evict_for(key, deadline, detached)
        finally:
            for served in detached:
                _close(served)

    def _evict_for(self, key: str, deadline: float, detached: list[ServedModel]) -> None:
        assert self.max_loaded is not None
        with self._lock:
            while len(self._served) + 1 > self.max_loaded:
                unpinned = [s for s in self._served if s.keep_alive is not None]
                if not unpinned:
                    raise ApiError(
                        ErrorKind.UNAVAILABLE,
                        f"cannot load model {key!r}: the {len(self._served)} loaded model(s) are pinned and "
                        f"--max-loaded-models is {self.max_loaded}",
                        param="model",
                    )
                idle = [s for s in unpinned if not self.in_use(s)]
                if idle:
                    detached.append(self._detach(min(idle, key=lambda s: s.last_used)))
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ApiError(
                        ErrorKind.OVERLOADED,
                        f"cannot load model {key!r}: every loaded model is busy and --max-loaded-models is "
                        f"{self.max_loaded}",
                        param="model",
                        status=503,
                        retry_after=5.0,
                    )
                self._changed.wait(min(left, 0.5))

    def unload(self, served: ServedModel) -> bool:
        """Unloads `served` now unless it is in use; True if it was unloaded."""
        with self._lock:
            if served not in self._served or self.in_use(served):
                return False
            self._detach(served)
        _close(served)
        return True

    def _detach(self, served: ServedModel) -> ServedModel:
        """Takes `served` out of the routing table (under the lock); `_close` frees it after."""
        self._served.remove(served)
        for name, other in list(self._by_name.items()):
            if other is served:
                del self._by_name[name]
        self._changed.notify_all()
        return served

    # ---- the reaper: unloads models whose keep_alive ran out
    def _start_reaper(self) -> None:
        with self._lock:
            if self._reaper is None and not self._closed:
                self._reaper = threading.Thread(target=self._reap, name="turbospark-reaper", daemon=True)
                self._reaper.start()

    def _reap(self) -> None:
        while True:
            detached: list[ServedModel] = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                stuck = False
                for served in list(self._served):
                    if served.keep_alive is None or now < served.last_used + served.keep_alive:
                        continue
                    if not self.in_use(served):
                        detached.append(self._detach(served))
                    elif not _engine_busy(served):
                        stuck = True  # leased, yet nothing runs: a plan caught in a reference cycle
                if not detached:
                    if stuck:
                        gc.collect()
                    waits = [
                        s.last_used + s.keep_alive - now
                        for s in self._served
                        if s.keep_alive is not None and not self.in_use(s)
                    ]
                    self._changed.wait(min([1.0, *[max(0.05, w) for w in waits]]))
            for served in detached:
                _close(served)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()


def _engine_busy(served: ServedModel) -> bool:
    """Whether the model's engine has sequences running or waiting."""
    scheduler = getattr(getattr(served.backend, "engine", None), "scheduler", None)
    return bool(scheduler is not None and scheduler.has_work())


def _close(served: ServedModel) -> None:
    """Stops the model's engine and hands its memory back."""
    log.info("unloading %s", served.model_id)
    close = getattr(served.backend, "close", None)
    if close is not None:
        close()
    else:
        engine = getattr(served.backend, "engine", None)
        if engine is not None:
            engine.stop(wait=5.0)
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
