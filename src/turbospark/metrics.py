"""A tiny process-level metrics registry, rendered in the Prometheus text format at `/metrics`.

Counters and gauges are module-level objects any part of the server increments (engine worker
threads included, hence the lock). `render()` is the exposition text; `routes()` mounts it.
Names follow Prometheus conventions: `turbospark_*`, counters end in `_total`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

_lock = threading.Lock()

LabelValues = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


class _Metric:
    kind = "untyped"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help
        self.labels = tuple(labels)
        self.values: dict[LabelValues, float] = {}

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {tuple(labels)}")
        return tuple(str(labels[k]) for k in self.labels)

    def get(self, **labels: str) -> float:
        with _lock:
            return self.values.get(self._key(labels), 0.0)

    def lines(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]
        for key, value in sorted(self.values.items()):
            if key:
                pairs = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(self.labels, key, strict=True))
                out.append(f"{self.name}{{{pairs}}} {_number(value)}")
            else:
                out.append(f"{self.name} {_number(value)}")
        return out


class Counter(_Metric):
    kind = "counter"

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with _lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def declare(self, **labels: str) -> None:
        """Shows a label set at 0 before it first happens, so dashboards see the series."""
        key = self._key(labels)
        with _lock:
            self.values.setdefault(key, 0.0)


class Gauge(_Metric):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with _lock:
            self.values[key] = value


class Registry:
    def __init__(self) -> None:
        self.metrics: dict[str, _Metric] = {}
        self.collectors: list[Callable[[], None]] = []

    def _add(self, metric: _Metric) -> _Metric:
        with _lock:
            existing = self.metrics.get(metric.name)
            if existing is not None:
                if type(existing) is not type(metric) or existing.labels != metric.labels:
                    raise ValueError(f"metric {metric.name} is already registered differently")
                return existing
            self.metrics[metric.name] = metric
            return metric

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        metric = self._add(Counter(name, help, labels))
        assert isinstance(metric, Counter)
        return metric

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        metric = self._add(Gauge(name, help, labels))
        assert isinstance(metric, Gauge)
        return metric

    def on_collect(self, fn: Callable[[], None]) -> None:
        """`fn` runs before each render, to set gauges from live state (queue depth, rate cap)."""
        self.collectors.append(fn)

    def render(self) -> str:
        for fn in list(self.collectors):
            fn()
        with _lock:
            lines = [line for metric in self.metrics.values() for line in metric.lines()]
        return "\n".join(lines) + "\n"


REGISTRY = Registry()
counter = REGISTRY.counter
gauge = REGISTRY.gauge
render = REGISTRY.render

TOOL_CALLS = counter(
    "turbospark_tool_calls_total",
    "Tool calls found in model output, by outcome (ok, repaired by the guardrails, returned as text)",
    ["outcome"],
)
TOOL_CALL_REPAIRS = counter(
    "turbospark_tool_call_repairs_total",
    "Guardrail repairs applied to tool calls, by kind (json, name, schema, arguments_string, unclosed)",
    ["kind"],
)
TOOL_CALL_REJECTS = counter(
    "turbospark_tool_call_rejects_total",
    "Tool calls returned as text because they could not be repaired, by reason",
    ["reason"],
)
GRAMMAR_REQUESTS = counter(
    "turbospark_grammar_constrained_total",
    "Generations run under a grammar constraint, by kind (tool_call, json_object, json_schema)",
    ["kind"],
)
for _outcome in ("ok", "repaired", "returned_as_text"):
    TOOL_CALLS.declare(outcome=_outcome)


ENGINE_STATE = gauge(
    "turbospark_engine_state",
    "Engine state per model: running and waiting sequences, KV blocks used and total",
    ["model", "what"],
)
ENGINE_EVENTS = counter(
    "turbospark_engine_events_total",
    "Engine totals per model: prefix-cache hit tokens, preemptions",
    ["model", "what"],
)
TOKENS = counter("turbospark_tokens_total", "Tokens through the engine: prompt (fed) and generated", ["kind"])
_LATENCY = {"first_token": [0.0, 0.0], "inter_token": [0.0, 0.0]}


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
    for what, value in (
        ("running", running),
        ("waiting", waiting),
        ("kv_blocks_used", blocks_used),
        ("kv_blocks_total", blocks_total),
    ):
        ENGINE_STATE.set(value, model=model, what=what)
    with _lock:
        ENGINE_EVENTS.values[(model, "prefix_hit_tokens")] = prefix_hit_tokens
        ENGINE_EVENTS.values[(model, "preemptions")] = preemptions


def count_step(num_fed: int, num_generated: int) -> None:
    TOKENS.inc(num_fed, kind="prompt")
    TOKENS.inc(num_generated, kind="generated")


def observe_first_token(seconds: float) -> None:
    pass


def observe_inter_token(seconds: float) -> None:
    pass


async def metrics_endpoint(request: Request) -> Response:
    return PlainTextResponse(render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def routes() -> list[Route]:
    return [Route("/metrics", metrics_endpoint, methods=["GET"])]
