"""Serving benchmark over HTTP: what vLLM's `benchmark_serving` reports, against a served model.

Streams `/v1/chat/completions` from many clients at once and reports, per scenario, request and
output-token throughput and the latency distributions (mean, p50, p90, p99): TTFT (request sent
to first content token), TPOT (per request: (end-to-end - TTFT) / (output tokens - 1)), ITL
(every gap between consecutive content chunks) and end-to-end latency. Output tokens are the
server's own count (`usage.completion_tokens`).

Scenarios: a closed loop at each `--concurrency` (N clients, each sending its next request when
the last one ends), a Poisson arrival process at `--request-rate` requests/s, and with
`--slow-reader` 8 streams twice, once all reading at full speed and once with one client that
sleeps between chunks behind a small socket receive buffer (so the server's writes to it really
block): the other seven's ITL should not move.

The server has no `ignore_eos`: each request sets `max_tokens` to `--output-len` and asks for a
long story, so a small model keeps talking; the actual output lengths are reported.

From the server's `/metrics` (read before and after each scenario) it also reports the engine's
per-step overhead: time outside the model forward (scheduling, sampling, handing tokens out) as
a share of step time, and the mean tokens per step.

    python benchmarks/bench_serving.py --serve "--model smollm2" --concurrency 1,8 \\
        --num-prompts 16 --input-len 128 --output-len 64
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --model smollm2 \\
        --request-rate 2 --concurrency ""

On a GPU with no real weights at hand, serve a random-weight folder of a real config
(`benchmarks/random_model.py`, which says what its tokenizer is and is not):

    python benchmarks/random_model.py --config llama-3.1-8b --out /tmp/rand-llama-8b
    python benchmarks/bench_serving.py --serve "--model /tmp/rand-llama-8b --device cuda \\
        --max-active 64 --max-waiting 512 --kv-cache-gb 24" --concurrency 64 --num-prompts 256 \\
        --input-len 64 --output-len 256

Offline vs HTTP on the same request set: `--offline` (needs `--serve ARGS`) also submits the
request set straight to the engine that `serve ARGS` runs, in this process, with no HTTP: the
registry and model are built by the CLI's own code for those arguments (`cli.serving_registry`,
`cli.load_into`), and each request is the HTTP body above (same prompts, max_tokens
`--output-len`, temperature 0.7, the served model's sampling defaults for the rest) planned by
the server's `make_plan`. All requests are submitted at once, bounded as the server bounds them
(`--max-active` running, `--max-waiting` in line, more as earlier ones finish); after one warm-up
request it reports the scenario "offline" in the same table and JSON (TTFT counts from
submission; ITL is the gap between tokens as the engine hands them out). With HTTP scenarios in
the same invocation, their server runs first and is stopped before the offline engine loads
(one model in GPU memory at a time), the offline run reuses the first closed loop's prompts
(fresh ones of the same make when the serve arguments keep a disk prefix cache), and
the ratio HTTP / offline of output tok/s, ms a step and tokens a step is printed (and written to
the JSON as `http_over_offline`). These numbers come from the served engine, not from
`bench_gpu.py`'s own loop. `--profile-steps N` in the serve arguments turns the engine's step
profile on (`turbospark.engine.profile`): the server, or the offline engine, logs the split of a
step's time every N steps, and the offline scenario also prints and writes it for its whole run.

    # both on one GPU, HTTP first, then offline (ratio printed):
    python benchmarks/bench_serving.py --serve "--model /tmp/rand-llama-8b --device cuda \\
        --max-active 64 --max-waiting 512 --kv-cache-gb 24" --concurrency 64 --num-prompts 256 \\
        --input-len 64 --output-len 256 --offline
    # offline alone, with the step profile; on CPU, the packaged default model:
    python benchmarks/bench_serving.py --serve "--model smollm2 --profile-steps 16" --offline \\
        --concurrency "" --num-prompts 8 --input-len 32 --output-len 16
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import platform
import queue
import random
import shlex
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent

TOPICS = [
    "a lighthouse keeper who finds a map",
    "a robot learning to cook",
    "two rival bakers in a small town",
    "a journey across a frozen sea",
    "a library that rearranges itself at night",
    "a detective who can hear colours",
    "the first colony on a distant moon",
    "a musician who lost her voice",
]
FILLER = (
    "The story should describe the places, the weather, the sounds and the people in rich detail, "
    "with dialogue, small surprises and many scenes that follow one another. "
)


_RUN = uuid.uuid4().hex[:8]
_serial = itertools.count()


def make_prompt(input_len: int) -> str:
    """About `input_len` tokens (a word is ~1.3 tokens). Every prompt of a run, and of every
    run, opens differently, so no scenario finds another's prompts in the prefix cache (only
    the chat template's shared head is cached, as in real serving)."""
    i = next(_serial)
    head = f"Request {_RUN}-{i}. Write a very long story about {TOPICS[i % len(TOPICS)]}. Never stop early. "
    words = head.split()
    filler = FILLER.split()
    while len(words) * 1.3 < input_len:
        words.append(filler[len(words) % len(filler)])
    return " ".join(words)


# ---- one request ----------------------------------------------------------------------------


@dataclass
class Result:
    ok: bool
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


def request_body(model: str, prompt: str, output_len: int) -> dict[str, Any]:
    """One request of the set, as sent over HTTP and as the offline mode plans it."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output_len,
        "temperature": 0.7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int, read_delay: float = 0.0
) -> Result:
    body = request_body(model, prompt, output_len)
    result = Result(ok=False, start=time.perf_counter())
    last = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    result.prompt_tokens = chunk["usage"]["prompt_tokens"]
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    if last is None:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                if read_delay:
                    await asyncio.sleep(read_delay)
    except httpx.HTTPError as exc:
        result.error = repr(exc)
        return result
    result.e2e = time.perf_counter() - result.start
    result.ok = last is not None
    return result


async def warm_up(url: str, model: str) -> None:
    async with new_client() as client:
        result = await one_request(client, url, model, make_prompt(16), 4)
    if not result.ok:
        raise SystemExit(f"warm-up request failed: {result.error or 'no content'}")


# ---- scenarios --------------------------------------------------------------------------------


@dataclass
class Scenario:
    name: str
    results: list[Result]
    duration: float
    engine: dict[str, float]


def new_client(rcvbuf: int | None = None) -> httpx.AsyncClient:
    options = [(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)] if rcvbuf else None
    transport = httpx.AsyncHTTPTransport(socket_options=options)
    return httpx.AsyncClient(
        transport=transport, timeout=httpx.Timeout(3600.0), limits=httpx.Limits(max_connections=1000)
    )


async def closed_loop(
    args: argparse.Namespace, url: str, model: str, concurrency: int, prompts: list[str]
) -> tuple[list[Result], float]:
    todo = list(enumerate(prompts))
    results: list[Result] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while todo:
            _, prompt = todo.pop(0)
            results.append(await one_request(client, url, model, prompt, args.output_len))

    async with new_client() as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        return results, time.perf_counter() - started


async def poisson(args: argparse.Namespace, url: str, model: str) -> tuple[list[Result], float]:
    rng = random.Random(args.seed)
    prompts = [make_prompt(args.input_len) for _ in range(args.num_prompts)]
    async with new_client() as client:
        started = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, args.output_len)))
            await asyncio.sleep(rng.expovariate(args.request_rate))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - started


async def slow_reader(
    args: argparse.Namespace, url: str, model: str, slow: bool
) -> tuple[list[Result], float]:
    """8 streams at once; with `slow`, the last one reads one chunk per `--slow-delay` seconds
    through a 4 KiB receive buffer. Returns the results of all 8 (the slow one last)."""
    prompts = [make_prompt(args.input_len) for _ in range(8)]
    async with new_client() as fast, new_client(rcvbuf=4096) as lagging:
        started = time.perf_counter()
        tasks = [one_request(fast, url, model, p, args.output_len) for p in prompts[:7]]
        if slow:
            tasks.append(
                one_request(lagging, url, model, prompts[7], args.output_len, read_delay=args.slow_delay)
            )
        else:
            tasks.append(one_request(fast, url, model, prompts[7], args.output_len))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - started


# ---- the server's /metrics ------------------------------------------------------------------


def engine_totals(url: str) -> dict[str, float]:
    """Step time by part, steps and generated tokens, summed over the served models."""
    totals = {"forward": 0.0, "overhead": 0.0, "steps": 0.0, "generated": 0.0, "prefix_hits": 0.0}
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError:
        return totals
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "turbospark_engine_step_seconds_total":
                totals[s.labels["part"]] = totals.get(s.labels["part"], 0.0) + s.value
            elif s.name == "turbospark_engine_steps_total":
                totals["steps"] += s.value
            elif s.name == "turbospark_generation_tokens_total":
                totals["generated"] += s.value
            elif s.name == "turbospark_prefix_cache_hit_tokens_total":
                totals["prefix_hits"] += s.value
    return totals


def run_scenario(name: str, url: str, coro_factory: Any) -> Scenario:
    before = engine_totals(url)
    results, duration = asyncio.run(coro_factory())
    after = engine_totals(url)
    return Scenario(name, results, duration, {k: after[k] - before.get(k, 0.0) for k in after})


# ---- offline: the served engine, no HTTP ----------------------------------------------------


class _Refused:
    """A request the engine's line refused (it was full): submitted again after a completion."""


class _Failed:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Outbox:
    """One request's items, stamped on arrival and put in the run's one queue."""

    __slots__ = ("index", "items")

    def __init__(self, index: int, items: queue.SimpleQueue[tuple[int, float, object]]) -> None:
        self.index = index
        self.items = items

    def put(self, item: object, /) -> None:
        self.items.put((self.index, time.perf_counter(), item))


def serve_namespace(serve_args: str) -> argparse.Namespace:
    """`turbospark serve ARGS` parsed by the CLI's own parser."""
    from turbospark import cli

    ns = cli.parser().parse_args(["serve", *shlex.split(serve_args)])
    cli.speculative_config(ns)  # a bad --speculative fails here, as serve refuses it
    return ns


def submit_one(backend: Any, plan: Any, index: int, items: queue.SimpleQueue[Any]) -> Any:
    """What the HTTP path does with a plan (`generate.stream_choice`): the backend's direct
    submission, else `run_completion` on a thread of its own. Returns the submission (None on
    the thread path); raises `EngineOverloaded` where the line is full."""
    from turbospark.backend import EngineOverloaded

    cancel = threading.Event()
    config = plan.config_for_choice(0)
    submission = backend.submit_completion(plan.prompt_ids, config, None, cancel, _Outbox(index, items))
    if submission is not None:
        return submission
    outbox = _Outbox(index, items)

    def work() -> None:
        try:
            outbox.put(backend.run_completion(plan.prompt_ids, config, None, cancel, outbox.put))
        except EngineOverloaded:
            outbox.put(_Refused())
        except BaseException as exc:
            outbox.put(_Failed(exc))

    threading.Thread(target=work, name="bench-offline", daemon=True).start()
    return None


def drive(
    registry: Any, engine: Any, model: str, prompts: list[str], output_len: int, limit: int
) -> tuple[list[Result], float]:
    """Plans every request as the server would (the same body, `make_plan`), submits them all,
    at most `limit` in the engine at once (the server's --max-active + --max-waiting: what it
    admits before answering 429), and waits for all. TTFT counts from submission, so it holds
    the wait in the engine's line; ITL is the gap between tokens as the engine hands them out."""
    from turbospark.api.openai import parse_chat_request
    from turbospark.backend import CompletionResult, EngineOverloaded, TokenEvent
    from turbospark.plan import make_plan

    plans = [make_plan(parse_chat_request(request_body(model, p, output_len))[0], registry) for p in prompts]
    items: queue.SimpleQueue[tuple[int, float, object]] = queue.SimpleQueue()
    results = [Result(ok=False) for _ in plans]
    last: list[float | None] = [None] * len(plans)
    in_flight: dict[int, Any] = {}
    todo = list(range(len(plans)))
    refused = False
    started = time.perf_counter()
    while todo or in_flight:
        while todo and (not refused or not in_flight) and len(in_flight) < limit:
            i = todo[0]
            results[i].start = time.perf_counter()
            try:
                in_flight[i] = submit_one(plans[i].backend, plans[i], i, items)
            except EngineOverloaded:
                refused = True  # again once a request has finished
                break
            todo.pop(0)
        try:
            i, at, raw = items.get(timeout=1.0)
        except queue.Empty:
            if not engine.alive():
                raise SystemExit("offline: the engine thread stopped") from None
            continue
        submission = in_flight.get(i)
        item: object = raw
        try:
            if isinstance(raw, _Failed):
                raise raw.error
            if submission is not None:
                item = submission.take(raw)
        except BaseException as exc:
            results[i].error = repr(exc)
            del in_flight[i]
            refused = False
            continue
        r = results[i]
        if isinstance(item, _Refused):
            del in_flight[i]
            todo.insert(0, i)
            refused = True
        elif isinstance(item, TokenEvent):
            seen = last[i]
            if seen is None:
                r.ttft = at - r.start
            else:
                r.itl.append(at - seen)
            last[i] = at
        elif isinstance(item, CompletionResult):
            r.e2e = at - r.start
            r.prompt_tokens = item.num_prompt_tokens
            r.output_tokens = len(item.token_ids)
            r.ok = r.output_tokens > 0
            if not r.ok:
                r.error = f"no tokens ({item.finish_reason.value})"
            del in_flight[i]
            refused = False
    return results, time.perf_counter() - started


def engine_counters(engine: Any) -> dict[str, float]:
    """The engine's own step counters (what /metrics exports for it)."""
    return {
        "forward": engine.step_seconds,
        "overhead": engine.overhead_seconds,
        "steps": float(engine.num_steps),
        "prefix_hits": float(engine.scheduler.num_prefix_hit_tokens),
    }


def kernel_profile(seconds: float, delay: float = 3.0) -> None:
    """`--kernel-profile`: the GPU's kernels over `seconds` of the offline run's steady state
    (after `delay`), by total time. CUPTI traces the whole process, the engine thread and the
    kernels inside CUDA graph replays included."""
    from torch.profiler import ProfilerActivity, profile

    time.sleep(delay)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        time.sleep(seconds)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=80))


def run_offline(args: argparse.Namespace, prompts: list[str]) -> tuple[Scenario, dict[str, Any] | None, str]:
    """The request set straight into the engine `serve ARGS` runs, in this process: the registry
    and its models built by the CLI's own code (`cli.serving_registry`, `load_into`), each
    request planned by the server's code. Returns the scenario, the engine's step profile over
    the measured requests (with --profile-steps in ARGS) and the model id."""
    from turbospark import cli
    from turbospark.registry import model_kinds

    ns = serve_namespace(args.serve)
    given = shlex.split(args.serve)
    level = ns.log_level if any(a.startswith("--log-level") for a in given) else "warning"
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    print("offline: loading the engine of serve " + args.serve, flush=True)
    registry = cli.serving_registry(ns)
    try:
        cli.load_into(registry, ns)
        served = [s for s in registry.served() if "completion" in model_kinds(s.backend)]
        model = args.model or served[0].model_id
        backend = registry.resolve(model).backend
        engine = getattr(backend, "engine", None)
        if engine is None:
            raise SystemExit(f"offline: model {model!r} runs no engine")
        config = engine.scheduler.config
        limit = config.max_active + config.max_waiting
        drive(registry, engine, model, [make_prompt(16)], 4, limit)  # warm-up (CUDA graphs)
        if engine.profile is not None:
            engine.profile.reset()
        before = engine_counters(engine)
        if args.kernel_profile:
            threading.Thread(target=kernel_profile, args=(args.kernel_profile,), daemon=True).start()
        results, duration = drive(registry, engine, model, prompts, args.output_len, limit)
        after = engine_counters(engine)
        delta = {k: after[k] - before[k] for k in after}
        delta["generated"] = float(sum(r.output_tokens for r in results if r.ok))
        profile = engine.profile.summary() if engine.profile is not None else None
        return Scenario("offline", results, duration, delta), profile, model
    finally:
        for s in registry.served():
            close = getattr(s.backend, "close", None)
            if close is not None:
                close()
        registry.close()


# ---- reporting ------------------------------------------------------------------------------


def dist(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    a = np.asarray(values) * 1000.0  # ms
    return {
        "mean": float(a.mean()),
        "p50": float(np.percentile(a, 50)),
        "p90": float(np.percentile(a, 90)),
        "p99": float(np.percentile(a, 99)),
    }


def summarize(s: Scenario) -> dict[str, Any]:
    ok = [r for r in s.results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    step_time = s.engine["forward"] + s.engine["overhead"]
    return {
        "scenario": s.name,
        "completed": len(ok),
        "failed": len(s.results) - len(ok),
        "errors": sorted({r.error for r in s.results if r.error})[:3],
        "duration_s": s.duration,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tokens": out_tokens,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "request_throughput": len(ok) / s.duration,
        "input_throughput": sum(r.prompt_tokens for r in ok) / s.duration,
        "output_throughput": out_tokens / s.duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / s.duration,
        "ttft_ms": dist([r.ttft for r in ok]),
        "tpot_ms": dist(tpot),
        "itl_ms": dist([g for r in ok for g in r.itl]),
        "e2el_ms": dist([r.e2e for r in ok]),
        "engine_steps": s.engine["steps"],
        "engine_overhead_share": s.engine["overhead"] / step_time if step_time else float("nan"),
        "engine_step_ms": 1000.0 * step_time / s.engine["steps"] if s.engine["steps"] else float("nan"),
        "prefix_cache_hit_tokens": s.engine["prefix_hits"],
        "tokens_per_step": s.engine["generated"] / s.engine["steps"] if s.engine["steps"] else float("nan"),
    }


def fmt(d: dict[str, float]) -> str:
    return f"{d['mean']:.1f} / {d['p50']:.1f} / {d['p90']:.1f} / {d['p99']:.1f}"


def print_summary(m: dict[str, Any]) -> None:
    print(f"\n{'=' * 18} {m['scenario']} {'=' * max(1, 40 - len(m['scenario']))}")
    print(f"{'completed / failed':<36}{m['completed']} / {m['failed']}")
    for err in m["errors"]:
        print(f"  error: {err}")
    print(f"{'duration (s)':<36}{m['duration_s']:.2f}")
    print(f"{'input / output tokens':<36}{m['input_tokens']} / {m['output_tokens']}")
    print(f"{'request throughput (req/s)':<36}{m['request_throughput']:.3f}")
    print(f"{'prompt token throughput (tok/s)':<36}{m['input_throughput']:.2f}")
    print(f"{'output token throughput (tok/s)':<36}{m['output_throughput']:.2f}")
    print(f"{'total token throughput (tok/s)':<36}{m['total_token_throughput']:.2f}")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2EL")):
        d = m[key]
        print(f"{label + ' ms mean/p50/p90/p99':<36}{fmt(d)}")
    print(
        f"{'engine: overhead share of a step':<36}{100 * m['engine_overhead_share']:.1f}% "
        f"({m['engine_steps']:.0f} steps, {m['engine_step_ms']:.1f} ms/step, "
        f"{m['tokens_per_step']:.2f} tokens/step)"
    )
    print(f"{'engine: prefix-cache hit tokens':<36}{m['prefix_cache_hit_tokens']:.0f}")


def hardware() -> str:
    parts = [platform.machine()]
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
        flags = set(fields.get("Flags", "").split())
        wanted = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
        parts.append(
            f"{fields.get('Model name', '?').strip()}, {fields.get('CPU(s)', '?').strip()} CPUs, "
            f"flags: {' '.join(wanted) or 'none of avx2/avx512/amx'}"
        )
    except (OSError, subprocess.CalledProcessError):
        parts.append(platform.processor() or "unknown CPU")
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        if gpus:
            parts.append("GPU: " + ", ".join(gpus.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        pass
    return "; ".join(parts)


# ---- the server under test ------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(serve_args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "turbospark", "serve", *shlex.split(serve_args)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    print("starting:", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server did not become healthy")


def run_http(args: argparse.Namespace, summaries: list[dict[str, Any]]) -> tuple[str, list[str]]:
    """The HTTP scenarios, against --base-url or a server `--serve` starts (and stops: an offline
    run after them loads the model again, in this process). Returns the model id and the
    prompts of the first closed loop (the offline run's request set)."""
    proc = None
    url = args.base_url.rstrip("/")
    if args.serve:
        proc, url = start_server(args.serve)
    try:
        model = args.model or httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        print(f"model: {model}; prompts ~{args.input_len} tokens, max_tokens {args.output_len}", flush=True)
        asyncio.run(warm_up(url, model))

        first: list[str] = []
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        for c in levels:
            prompts = [make_prompt(args.input_len) for _ in range(args.num_prompts)]
            first = first or prompts
            s = run_scenario(
                f"concurrency {c}", url, lambda c=c, p=prompts: closed_loop(args, url, model, c, p)
            )
            summaries.append(summarize(s))
            print_summary(summaries[-1])
        if args.request_rate:
            s = run_scenario(f"poisson {args.request_rate:g} req/s", url, lambda: poisson(args, url, model))
            summaries.append(summarize(s))
            print_summary(summaries[-1])
        if args.slow_reader:
            reader = {}
            for slow in (False, True):
                s = run_scenario(
                    "8 streams" + (", one slow reader" if slow else ""),
                    url,
                    lambda slow=slow: slow_reader(args, url, model, slow),
                )
                summary = summarize(s)
                seven = Scenario(s.name, s.results[:7], s.duration, s.engine)
                summary["itl_ms_other_seven"] = dist([g for r in seven.results if r.ok for g in r.itl])
                summary["slow_reader_e2e_s"] = s.results[7].e2e
                summaries.append(summary)
                reader[slow] = summary
                print_summary(summary)
                print(f"{'ITL ms, the other seven':<36}{fmt(summary['itl_ms_other_seven'])}")
            a, b = reader[False]["itl_ms_other_seven"], reader[True]["itl_ms_other_seven"]
            print(
                f"\nslow reader: other seven's ITL p50 {a['p50']:.1f} -> {b['p50']:.1f} ms, "
                f"p99 {a['p99']:.1f} -> {b['p99']:.1f} ms "
                f"(the slow stream took {reader[True]['slow_reader_e2e_s']:.1f} s)"
            )

        by_name = {m["scenario"]: m for m in summaries}
        if levels and 1 in levels:
            base = by_name["concurrency 1"]["output_throughput"]
            print("\noutput tokens/s vs concurrency 1:")
            for c in levels:
                m = by_name[f"concurrency {c}"]
                print(f"  {c:>3}: {m['output_throughput']:8.2f} tok/s  x{m['output_throughput'] / base:.2f}")
        return model, first
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def http_over_offline(
    summaries: list[dict[str, Any]], offline: dict[str, Any]
) -> dict[str, dict[str, float]]:
    """Each HTTP scenario's output tok/s, ms a step and tokens a step over the offline run's."""

    def ratio(a: float, b: float) -> float:
        return a / b if b else float("nan")

    return {
        m["scenario"]: {
            "output_throughput": ratio(m["output_throughput"], offline["output_throughput"]),
            "engine_step_ms": ratio(m["engine_step_ms"], offline["engine_step_ms"]),
            "tokens_per_step": ratio(m["tokens_per_step"], offline["tokens_per_step"]),
        }
        for m in summaries
        if m["scenario"] != "offline"
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--serve",
        metavar="ARGS",
        help='start `turbospark serve ARGS` on a free loopback port, e.g. "--model smollm2"',
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="also run the request set straight into the engine `serve ARGS` builds, in this "
        "process, with no HTTP (needs --serve; after the HTTP scenarios, whose server is stopped "
        'first); --concurrency "" runs it alone',
    )
    p.add_argument("--model", help="model id to request (default: the server's first in /v1/models)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=128, help="approximate prompt tokens")
    p.add_argument("--output-len", type=int, default=64, help="max_tokens of each request")
    p.add_argument(
        "--concurrency", default="1,4,8,16", help='closed-loop concurrencies, comma-separated ("" for none)'
    )
    p.add_argument("--request-rate", type=float, help="also run Poisson arrivals at this many requests/s")
    p.add_argument(
        "--slow-reader", action="store_true", help="also run 8 streams with and without one slow reader"
    )
    p.add_argument("--slow-delay", type=float, default=0.25, help="seconds the slow reader sleeps per chunk")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--kernel-profile",
        type=float,
        default=0.0,
        help="with --offline on a GPU: print the kernels' time over this many seconds of it",
    )
    p.add_argument("--result-json", help="write every scenario's summary here")
    args = p.parse_args(argv)
    if args.offline and not args.serve:
        p.error("--offline needs --serve ARGS: the engine is built as `serve ARGS` builds it")
    if args.offline:
        serve_namespace(args.serve)  # bad serve arguments fail before any server starts

    print(f"hardware: {hardware()}", flush=True)
    summaries: list[dict[str, Any]] = []
    model, prompts = args.model, []
    if any(c.strip() for c in args.concurrency.split(",")) or args.request_rate or args.slow_reader:
        model, prompts = run_http(args, summaries)
    result: dict[str, Any] = {"hardware": hardware(), "model": model, "args": vars(args)}
    if args.offline:
        if not prompts or cli_disk_cache(args.serve):  # a disk prefix cache would hold these
            prompts = [make_prompt(args.input_len) for _ in range(args.num_prompts)]
        scenario, profile, model = run_offline(args, prompts)
        offline = summarize(scenario)
        summaries.append(offline)
        print_summary(offline)
        if profile is not None:
            offline["step_profile"] = profile
            print("\nengine step profile over the offline requests (mean ms a step):")
            print(format_table(profile))
        ratios = http_over_offline(summaries, offline)
        if ratios:
            result["http_over_offline"] = ratios
            print("\nHTTP / offline (output tok/s, ms a step, tokens a step):")
            for name, r in ratios.items():
                print(
                    f"  {name:<28} x{r['output_throughput']:.2f}   x{r['engine_step_ms']:.2f}   "
                    f"x{r['tokens_per_step']:.2f}"
                )
    if args.result_json:
        result["model"] = model
        Path(args.result_json).write_text(json.dumps({**result, "scenarios": summaries}, indent=2))
    return 0


def cli_disk_cache(serve_args: str) -> bool:
    """Whether `serve ARGS` keeps a disk prefix cache (the offline run then gets fresh prompts)."""
    from turbospark import cli

    return cli.disk_cache_gb(serve_namespace(serve_args)) > 0


def format_table(profile: dict[str, Any]) -> str:
    from turbospark.engine.profile import format_table as table

    return table(profile)


if __name__ == "__main__":
    sys.exit(main())
