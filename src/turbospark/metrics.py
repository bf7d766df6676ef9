"""Process metrics through `prometheus_client`, served at `/metrics`.

Everything lives in one dedicated `CollectorRegistry` (`REGISTRY`), not the library's global
one, so an embedding process keeps its own metrics apart. Three kinds of source feed it:

- counters and histograms the server moves as things happen: requests by API and status (the
  `RequestMetrics` ASGI middleware), tool-call outcomes, grammar use, and per model the tokens,
  time to first token, inter-token and end-to-end latency (the engine calls `count_step`,
  `observe_first_token`, `observe_inter_token`, `observe_request`);
- engine state the engine pushes each step (`set_engine_state`: a dict write, rendered on
  scrape), and the step timing of every engine registered with `watch_engine`;
- the process `RateControl` registered with `watch_rate`, read on scrape: the cap in force and
  the temperature it last read.

Per-token work is one histogram observe on a cached child; everything else happens per step
or per scrape. Names follow Prometheus conventions: `turbospark_*`, counters end in `_total`,
times in seconds.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# `*_created` timestamps double the text and no dashboard here reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

REGISTRY = CollectorRegistry()


def sample(name: str, **labels: str) -> float:
    """The current value of one sample (0 when it has not appeared yet), e.g.
    `sample("turbospark_tool_calls_total", outcome="ok")`."""
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


# ---- requests by API -------------------------------------------------------------------------

REQUESTS = Counter(
    "turbospark_requests",
    "HTTP requests to the inference APIs, by API and response status",
    ["api", "status"],
    registry=REGISTRY,
)

# Longest prefix first; paths outside these (health, metrics, model lists, tokenize) are not counted.
_API_PREFIXES = (
    ("/v1/chat/completions", "openai"),
    ("/v1/completions", "openai"),
    ("/v1/embeddings", "openai"),
    ("/v1/responses", "responses"),
    ("/v1/messages", "anthropic"),
    ("/api/", "ollama"),
)


def api_of(path: str) -> str | None:
    for prefix, api in _API_PREFIXES:
        if path == prefix or path.startswith(prefix if prefix.endswith("/") else prefix + "/"):
            return api
    return None


class RequestMetrics:
    """Pure ASGI middleware counting `turbospark_requests_total{api,status}` when the response
    starts (a streamed reply counts once, at its headers). Pure ASGI rather than Starlette's
    `BaseHTTPMiddleware`, which would buffer the body of streamed replies through a task group."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        api = api_of(scope["path"]) if scope["type"] == "http" else None
        if api is None:
            await self.app(scope, receive, send)
            return
        started = False

        async def send_counting(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                REQUESTS.labels(api, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        except Exception:
            if not started:  # the server's error handler answers 500 outside this middleware
                REQUESTS.labels(api, "500").inc()
            raise


# ---- tool calls and grammar (names and label sets are a published interface) -----------------

TOOL_CALLS = Counter(
    "turbospark_tool_calls",
    "Tool calls found in model output, by outcome (ok, repaired by the guardrails, returned as text)",
    ["outcome"],
    registry=REGISTRY,
)
TOOL_CALL_REPAIRS = Counter(
    "turbospark_tool_call_repairs",
    "Guardrail repairs applied to tool calls, by kind (json, name, schema, arguments_string, unclosed, "
    "unwrapped, code_fence, shape, junk_prefix)",
    ["kind"],
    registry=REGISTRY,
)
TOOL_CALL_REJECTS = Counter(
    "turbospark_tool_call_rejects",
    "Tool calls returned as text because they could not be repaired, by reason",
    ["reason"],
    registry=REGISTRY,
)
GRAMMAR_REQUESTS = Counter(
    "turbospark_grammar_constrained",
    "Generations run under a grammar constraint, by kind "
    "(tool_call, tool_call_lazy, json_object, json_schema)",
    ["kind"],
    registry=REGISTRY,
)
LOOPS_BROKEN = Counter(
    "turbospark_loops_broken",
    "Loops the loop guard made a reply leave (serve --loop-guard): one short block repeated "
    "for the guard's window of tokens",
    ["model"],
    registry=REGISTRY,
)
TOOL_STEERING = Counter(
    "turbospark_tool_steering",
    "requests whose tool list the server narrowed for the model: focus (`serve --tool-focus`: the "
    "model read only the named tools) or repeat (a call just made twice alike may not start again)",
    ["kind"],
    registry=REGISTRY,
)
LAZY_TRIGGERS = Counter(
    "turbospark_tool_call_constraint_triggers",
    "tool_choice auto: calls the model started that the call grammar then held (form tag or bare), "
    "or that it could not hold because the written start did not fit (missed)",
    ["form"],
    registry=REGISTRY,
)
for _outcome in ("ok", "repaired", "returned_as_text"):
    TOOL_CALLS.labels(outcome=_outcome)  # shown at 0 before it first happens


# ---- per-model tokens and latencies (the engine's hot path) ----------------------------------

# From a GPU decode step (a few ms) to a long CPU generation behind a queue (minutes).
_TTFT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
_E2E_BUCKETS = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0, 1280.0,
)  # fmt: skip

PROMPT_TOKENS = Counter(
    "turbospark_prompt_tokens",
    "Prompt tokens of finished requests, prefix-cache hits included (as usage reports them)",
    ["model"],
    registry=REGISTRY,
)
GENERATION_TOKENS = Counter(
    "turbospark_generation_tokens", "Tokens generated, counted per engine step", ["model"], registry=REGISTRY
)
FORWARD_TOKENS = Counter(
    "turbospark_forward_tokens",
    "Tokens fed through the model forward (prompt chunks and decode inputs; prefix-cache hits skip it)",
    ["model"],
    registry=REGISTRY,
)
ENGINE_REQUESTS = Counter(
    "turbospark_engine_requests",
    "Requests the engine finished, by finish reason (stop, length, cancelled)",
    ["model", "finish_reason"],
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "turbospark_time_to_first_token_seconds",
    "From a request reaching the engine (waiting included) to its first generated token",
    ["model"],
    buckets=_TTFT_BUCKETS,
    registry=REGISTRY,
)
INTER_TOKEN_LATENCY = Histogram(
    "turbospark_inter_token_latency_seconds",
    "Between consecutive generated tokens of one request",
    ["model"],
    buckets=_ITL_BUCKETS,
    registry=REGISTRY,
)
REQUEST_LATENCY = Histogram(
    "turbospark_e2e_request_latency_seconds",
    "From a request reaching the engine to its result being handed back",
    ["model"],
    buckets=_E2E_BUCKETS,
    registry=REGISTRY,
)

SPEC_PROPOSED = Counter(
    "turbospark_spec_proposed_tokens",
    "Speculative draft tokens verified, by proposer",
    ["model", "proposer"],
    registry=REGISTRY,
)
SPEC_ACCEPTED = Counter(
    "turbospark_spec_accepted_tokens",
    "Speculative draft tokens accepted, by proposer",
    ["model", "proposer"],
    registry=REGISTRY,
)
SPEC_VERIFICATIONS = Counter(
    "turbospark_spec_verifications",
    "Sequence-steps that verified drafts, by proposer (accepted / verifications: the mean accepted length)",
    ["model", "proposer"],
    registry=REGISTRY,
)
SPEC_ACCEPTANCE = Histogram(
    "turbospark_spec_acceptance_rate",
    "Per verification, the share of its drafts accepted, by proposer",
    ["model", "proposer"],
    buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
    registry=REGISTRY,
)

_children: dict[tuple[int, str], Any] = {}


def _child(metric: Counter | Histogram, model: str) -> Any:
    """`metric.labels(model)`, cached: `labels()` validates and locks on every call."""
    key = (id(metric), model)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(model)
    return child


def count_step(model: str, num_fed: int, num_generated: int) -> None:
    """Once per engine step: tokens through the forward, tokens handed out."""
    _child(FORWARD_TOKENS, model).inc(num_fed)
    _child(GENERATION_TOKENS, model).inc(num_generated)


def count_speculation(model: str, proposer: str, proposed: int, accepted: int, rates: list[float]) -> None:
    """Once per engine step that verified drafts: totals, and each verification's acceptance."""
    SPEC_PROPOSED.labels(model, proposer).inc(proposed)
    SPEC_ACCEPTED.labels(model, proposer).inc(accepted)
    SPEC_VERIFICATIONS.labels(model, proposer).inc(len(rates))
    histogram = SPEC_ACCEPTANCE.labels(model, proposer)
    for rate in rates:
        histogram.observe(rate)


def observe_first_token(model: str, seconds: float) -> None:
    _child(TIME_TO_FIRST_TOKEN, model).observe(seconds)


def observe_inter_token(model: str, seconds: float) -> None:
    _child(INTER_TOKEN_LATENCY, model).observe(seconds)


def observe_request(
    model: str, seconds: float, *, prompt_tokens: int, finish_reason: str, loops_broken: int = 0
) -> None:
    """Once per request, when its result is handed back."""
    _child(REQUEST_LATENCY, model).observe(seconds)
    _child(PROMPT_TOKENS, model).inc(prompt_tokens)
    ENGINE_REQUESTS.labels(model, finish_reason).inc()
    if loops_broken:
        LOOPS_BROKEN.labels(model).inc(loops_broken)


# ---- engine state and step timing (read on scrape) -------------------------------------------


class _EngineState:
    __slots__ = ("blocks_total", "blocks_used", "preemptions", "prefix_hit_tokens", "running", "waiting")

    def __init__(self, running: int, waiting: int, used: int, total: int, hits: int, preempts: int) -> None:
        self.running, self.waiting, self.blocks_used, self.blocks_total = running, waiting, used, total
        self.prefix_hit_tokens, self.preemptions = hits, preempts


_engine_states: dict[str, _EngineState] = {}


def set_engine_state(
    model: str,
    *,
    running: int,
    waiting: int,
    blocks_used: int,
    blocks_total: int,
    prefix_hit_tokens: int,
    preemptions: int,
) -> None:
    """The engine's latest state (running totals for hits and preemptions); one dict write."""
    _engine_states[model] = _EngineState(
        running, waiting, blocks_used, blocks_total, prefix_hit_tokens, preemptions
    )


class EngineTimes(Protocol):
    """What `watch_engine` reads: the engine's name and its running step totals."""

    name: str
    num_steps: int
    step_seconds: float  # inside the model forward
    overhead_seconds: float  # the rest of a step: schedule, sample, hand-out


_engines: weakref.WeakSet[Any] = weakref.WeakSet()


def watch_engine(engine: EngineTimes) -> None:
    """Exports the engine's step totals while it lives (engines of one name are summed)."""
    _engines.add(engine)


def _engine_families() -> Iterator[Metric]:
    running = GaugeMetricFamily(
        "turbospark_running_sequences", "Sequences in the running batch", labels=["model"]
    )
    waiting = GaugeMetricFamily(
        "turbospark_waiting_sequences", "Sequences waiting to start", labels=["model"]
    )
    used = GaugeMetricFamily(
        "turbospark_kv_blocks_used", "KV-cache blocks held by sequences", labels=["model"]
    )
    total = GaugeMetricFamily(
        "turbospark_kv_blocks_capacity", "KV-cache blocks in the budget", labels=["model"]
    )
    hits = CounterMetricFamily(
        "turbospark_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", labels=["model"]
    )
    preempt = CounterMetricFamily(
        "turbospark_preemptions", "Sequences preempted for KV-cache room (recomputed later)", labels=["model"]
    )
    for model, s in list(_engine_states.items()):
        running.add_metric([model], s.running)
        waiting.add_metric([model], s.waiting)
        used.add_metric([model], s.blocks_used)
        total.add_metric([model], s.blocks_total)
        hits.add_metric([model], s.prefix_hit_tokens)
        preempt.add_metric([model], s.preemptions)
    yield from (running, waiting, used, total, hits, preempt)

    times: dict[str, list[float]] = {}
    for engine in list(_engines):
        t = times.setdefault(engine.name, [0.0, 0.0, 0.0])
        t[0] += engine.step_seconds
        t[1] += engine.overhead_seconds
        t[2] += engine.num_steps
    seconds = CounterMetricFamily(
        "turbospark_engine_step_seconds",
        "Engine step time: inside the model forward, and the overhead around it (schedule, sample, hand-out)",
        labels=["model", "part"],
    )
    steps = CounterMetricFamily(
        "turbospark_engine_steps", "Engine steps that ran the model", labels=["model"]
    )
    for model, (forward, overhead, num_steps) in times.items():
        seconds.add_metric([model, "forward"], forward)
        seconds.add_metric([model, "overhead"], overhead)
        steps.add_metric([model], num_steps)
    yield from (seconds, steps)


# ---- the decode-rate cap and the temperature behind it (read on scrape) ----------------------


class RateSource(Protocol):
    """What `watch_rate` reads (`turbospark.ratecontrol.RateControl`)."""

    temperature: Any  # a TemperatureSource with a `name`, or None
    last_temperature: float | None
    seconds_slept: float

    def cap(self) -> float | None: ...


_rate: list[RateSource] = []
_rate_lock = threading.Lock()


def watch_rate(rate: RateSource) -> None:
    """Exports the process's rate control (the last one registered)."""
    with _rate_lock:
        _rate[:] = [rate]


def _rate_families() -> Iterator[Metric]:
    with _rate_lock:
        rate = _rate[0] if _rate else None
    cap = GaugeMetricFamily(
        "turbospark_decode_rate_cap_tokens_per_second",
        "Decode-rate cap in force for the whole process, thermal steps applied (absent: no cap)",
    )
    temp = GaugeMetricFamily(
        "turbospark_temperature_celsius", "Last temperature the rate control read", labels=["source"]
    )
    slept = CounterMetricFamily(
        "turbospark_decode_rate_paced_seconds", "Time engine steps waited for the decode-rate cap"
    )
    if rate is not None:
        value = rate.cap()  # also takes a fresh reading when the poll interval has passed
        if value is not None:
            cap.add_metric([], value)
        if rate.last_temperature is not None and rate.temperature is not None:
            temp.add_metric([str(rate.temperature.name)], rate.last_temperature)
        slept.add_metric([], rate.seconds_slept)
    yield from (cap, temp, slept)


class _Live(Collector):
    def __init__(self, *sources: Callable[[], Iterable[Metric]]) -> None:
        self.sources = sources

    def collect(self) -> Iterable[Metric]:
        for source in self.sources:
            yield from source()


REGISTRY.register(_Live(_engine_families, _rate_families))


# ---- the route ----------------------------------------------------------------------------------


def metrics_endpoint(request: Request) -> Response:
    """Plain text by default; OpenMetrics when the scraper asks for it. A sync handler: Starlette
    runs it in its thread pool, so a slow temperature read never blocks the event loop."""
    encode, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encode(REGISTRY), headers={"Content-Type": content_type})


def routes() -> list[Route]:
    return [Route("/metrics", metrics_endpoint, methods=["GET"])]
