"""Bounded soak over loopback: many streaming clients against `turbospark serve --model scripted`.

Starts its own server on a free 127.0.0.1 port with the scripted backend reading one fixed
reply from a file, then runs `--clients` concurrent streaming clients for `--seconds`, each
sending request after request, spread round-robin over four APIs: OpenAI chat completions,
Anthropic messages, OpenAI Responses and Ollama chat. A third of the clients hang up on every
request at a random point: before the first byte of the reply, or after a random number of
stream events.

Each request asks for an echo of its own nonce, but the scripted backend replays its reply
whatever the prompt, so correctness is checked another way: every client has its own token
limit (`max_tokens`, `max_output_tokens`, `num_predict`), distinct from every other client's,
and the scripted tokenizer makes one token per byte. A completed stream must therefore carry
exactly the reply's first `min(limit, len(reply))` bytes, with a finish reason (length or stop)
and a token count that agree. Any other text is a mismatch: lost, torn, or mixed with another
request's tokens.

Then, unless `--real-model none`, a real model (`--real-model`, default smollm2) is served and
each API gets `--real-requests` sampled requests, each sent streamed and not: with a `seed`
where the API has one (OpenAI chat, Ollama `options.seed`) at temperature 0.8, greedy where it
has none (Anthropic, Responses). Each prompt is sent once before the pair, so both meet the same
prefix cache (a prompt's tail recomputed after a cache hit rounds differently from the same
tokens inside a whole-prompt chunk on the quantized CPU path). The streamed text must equal the
non-streamed text.

After the clients stop and a short settle it reads `/metrics`: running and waiting sequences
and KV blocks held must all be back to 0. The server's RSS (VmRSS) is read after `--warmup`
seconds and at the end; it may grow by under `--max-rss-growth` percent. Prints a summary and
exits 1 if anything is off.

    python benchmarks/soak.py --seconds 300

`--url URL --pid PID` soaks a server started elsewhere instead (say, under a memory profiler);
it must serve this script's reply as model `scripted`, and is neither started nor stopped here.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import platform
import random
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turbospark.testing import ServerProcess

REPLY = (
    "Soak reply: the quick brown fox jumps over the lazy dog, then counts 0123456789 and stops right here."
)
APIS = ("openai", "anthropic", "responses", "ollama")
MIN_LIMIT = 16  # the Responses API's smallest max_output_tokens
REAL_MAX_TOKENS = 40


@dataclass
class Outcome:
    """What one request ended as."""

    api: str
    kind: str  # completed | disconnected | error | mismatch
    detail: str = ""
    early: bool = False  # disconnected before any byte of the body arrived


@dataclass
class Tally:
    by_api: collections.Counter[str] = field(default_factory=collections.Counter)
    kinds: collections.Counter[str] = field(default_factory=collections.Counter)
    by_api_kind: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    early_disconnects: int = 0
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    mismatch_examples: list[str] = field(default_factory=list)

    def add(self, o: Outcome) -> None:
        self.by_api[o.api] += 1
        self.kinds[o.kind] += 1
        self.by_api_kind[(o.api, o.kind)] += 1
        if o.kind == "disconnected" and o.early:
            self.early_disconnects += 1
        if o.kind == "error":
            self.errors[o.detail] += 1
        if o.kind == "mismatch" and len(self.mismatch_examples) < 5:
            self.mismatch_examples.append(o.detail)


# ---- one request per API: the body, and a parser of its stream into (text, finish, tokens) ----


def request_for(api: str, model: str, nonce: str, limit: int) -> tuple[str, dict[str, Any]]:
    prompt = f"Reply with exactly this nonce and nothing else: {nonce}"
    messages = [{"role": "user", "content": prompt}]
    if api == "openai":
        return "/v1/chat/completions", {
            "model": model,
            "messages": messages,
            "stream": True,
            "max_tokens": limit,
            "stream_options": {"include_usage": True},
        }
    if api == "anthropic":
        return "/v1/messages", {"model": model, "messages": messages, "stream": True, "max_tokens": limit}
    if api == "responses":
        return "/v1/responses", {"model": model, "input": prompt, "stream": True, "max_output_tokens": limit}
    return "/api/chat", {
        "model": model,
        "messages": messages,
        "stream": True,
        "options": {"num_predict": limit},
    }


async def events(response: httpx.Response, api: str) -> AsyncIterator[dict[str, Any]]:
    """Each JSON event of the stream: SSE `data:` lines, or NDJSON lines for Ollama."""
    async for line in response.aiter_lines():
        if api == "ollama":
            if line.strip():
                yield json.loads(line)
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


@dataclass
class Parsed:
    text: list[str] = field(default_factory=list)
    finish: str | None = None  # "length" or "stop", normalised across APIs
    tokens: int | None = None  # the server's own count of generated tokens
    ended: bool = False  # the stream's terminal event arrived


def take(api: str, ev: dict[str, Any], p: Parsed) -> None:
    if api == "openai":
        for choice in ev.get("choices") or []:
            p.text.append(choice.get("delta", {}).get("content") or "")
            if choice.get("finish_reason"):
                p.finish = choice["finish_reason"]
        if ev.get("usage"):
            p.tokens = ev["usage"]["completion_tokens"]
            p.ended = True  # the usage chunk is the last one asked for
    elif api == "anthropic":
        kind = ev.get("type")
        if kind == "content_block_delta" and ev["delta"].get("type") == "text_delta":
            p.text.append(ev["delta"]["text"])
        elif kind == "message_delta":
            reason = ev["delta"].get("stop_reason")
            p.finish = {"max_tokens": "length", "end_turn": "stop"}.get(reason, reason)
            p.tokens = ev.get("usage", {}).get("output_tokens")
        elif kind == "message_stop":
            p.ended = True
        elif kind == "error":
            raise RuntimeError(f"error event: {ev}")
    elif api == "responses":
        kind = ev.get("type")
        if kind == "response.output_text.delta":
            p.text.append(ev["delta"])
        elif kind in ("response.completed", "response.incomplete"):
            r = ev["response"]
            reason = (r.get("incomplete_details") or {}).get("reason")
            p.finish = (
                "length"
                if reason == "max_output_tokens"
                else ("stop" if r["status"] == "completed" else reason)
            )
            p.tokens = (r.get("usage") or {}).get("output_tokens")
            p.ended = True
        elif kind in ("error", "response.failed"):
            raise RuntimeError(f"error event: {ev}")
    else:
        p.text.append((ev.get("message") or {}).get("content") or "")
        if ev.get("done"):
            p.finish = ev.get("done_reason")
            p.tokens = ev.get("eval_count")
            p.ended = True


def check(p: Parsed, limit: int) -> str:
    """Empty when the stream is exactly what its limit allows; else what is wrong."""
    want = REPLY[:limit]
    text = "".join(p.text)
    if not p.ended:
        return f"stream ended without its terminal event after {len(text)} chars"
    if text != want:
        return f"limit {limit}: text {text!r} != {want!r}"
    want_finish = "length" if limit < len(REPLY) else "stop"
    if p.finish != want_finish:
        return f"limit {limit}: finish {p.finish!r}, expected {want_finish!r}"
    # With a stop, the end-of-turn token may or may not be counted; with a limit, exactly `limit`.
    ok_tokens = {limit} if want_finish == "length" else {len(REPLY), len(REPLY) + 1}
    if p.tokens not in ok_tokens:
        return f"limit {limit}: {p.tokens} tokens counted, expected one of {sorted(ok_tokens)}"
    return ""


async def one_request(
    http: httpx.AsyncClient, api: str, model: str, limit: int, hang_up: str | None, rng: random.Random
) -> Outcome:
    path, body = request_for(api, model, uuid.uuid4().hex, limit)
    got_bytes = False
    stop_after = rng.randint(1, 40) if hang_up == "mid" else 0

    async def run() -> Outcome:
        nonlocal got_bytes
        async with http.stream("POST", path, json=body) as response:
            got_bytes = True
            if response.status_code != 200:
                await response.aread()
                return Outcome(api, "error", f"HTTP {response.status_code}")
            p = Parsed()
            seen = 0
            try:
                async for ev in events(response, api):
                    take(api, ev, p)
                    seen += 1
                    if hang_up == "mid" and seen >= stop_after:
                        return Outcome(api, "disconnected")  # leaving the block closes the socket
            except RuntimeError as e:
                return Outcome(api, "error", str(e)[:120])
            # A "mid" hang-up whose chosen point lay past the stream's end completed: checked.
            problem = check(p, limit)
            return Outcome(api, "mismatch", f"{api} {problem}") if problem else Outcome(api, "completed")

    if hang_up == "early":
        try:
            # A few milliseconds: usually before the reply's headers, sometimes just after.
            return await asyncio.wait_for(run(), timeout=rng.uniform(0.0005, 0.02))
        except TimeoutError:
            return Outcome(api, "disconnected", early=not got_bytes)
    try:
        return await asyncio.wait_for(run(), timeout=120)
    except TimeoutError:
        return Outcome(api, "error", "client timeout (120 s)")
    except httpx.HTTPError as e:
        return Outcome(api, "error", f"{type(e).__name__}")


async def client(
    index: int, http: httpx.AsyncClient, model: str, deadline: float, tally: Tally, seed: int
) -> None:
    rng = random.Random(seed * 1000 + index)
    limit = MIN_LIMIT + 2 * index  # distinct per client; some above the reply's length
    hangs = index % 3 == 0
    n = 0
    while time.monotonic() < deadline:
        api = APIS[(index + n) % len(APIS)]
        hang_up = rng.choice(("early", "mid")) if hangs else None
        tally.add(await one_request(http, api, model, limit, hang_up, rng))
        n += 1


# ---- a real model: streamed text == non-streamed text for seeded / greedy requests ------------


def real_body(api: str, model: str, prompt: str, seed: int, stream: bool) -> tuple[str, dict[str, Any]]:
    path, body = request_for(api, model, "", REAL_MAX_TOKENS)
    body["stream"] = stream
    if api == "openai":
        body.update(messages=[{"role": "user", "content": prompt}], seed=seed, temperature=0.8)
        if not stream:
            body.pop("stream_options")
    elif api == "anthropic":
        body.update(messages=[{"role": "user", "content": prompt}], temperature=0.0)
    elif api == "responses":
        body.update(input=prompt, temperature=0.0)
    else:
        body.update(messages=[{"role": "user", "content": prompt}])
        body["options"].update(seed=seed, temperature=0.8)
    return path, body


def whole_text(api: str, reply: dict[str, Any]) -> str:
    """The text of a non-streamed reply, per API."""
    if api == "openai":
        return reply["choices"][0]["message"]["content"] or ""
    if api == "anthropic":
        return "".join(b.get("text", "") for b in reply["content"] if b["type"] == "text")
    if api == "responses":
        return "".join(
            c.get("text", "")
            for item in reply["output"]
            if item["type"] == "message"
            for c in item["content"]
        )
    return reply["message"]["content"] or ""


async def streamed_text(http: httpx.AsyncClient, api: str, path: str, body: dict[str, Any]) -> str:
    async with http.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        p = Parsed()
        async for ev in events(response, api):
            take(api, ev, p)
        if not p.ended:
            raise RuntimeError("stream ended without its terminal event")
        return "".join(p.text)


async def real_model_check(base: str, model: str, count: int, seed: int) -> list[str]:
    """Mismatches (empty: every streamed reply equalled its non-streamed twin)."""
    problems = []
    topics = ("the sea", "a lighthouse", "autumn rain", "a train at night", "mountain air", "old books")
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(300)) as http:
        for api in APIS:
            for i in range(count):
                prompt = f"Write two sentences about {topics[i % len(topics)]}."
                path, body = real_body(api, model, prompt, seed + i, stream=False)
                # once first, so both compared requests meet the same prefix cache: a cold
                # prompt is computed in one chunk, a warm one only past its cached blocks, and
                # the quantized CPU matmuls do not round the same for a different row count
                await http.post(path, json=body)
                reply = await http.post(path, json=body)
                if reply.status_code != 200:
                    problems.append(f"{api} #{i}: HTTP {reply.status_code}: {reply.text[:200]}")
                    continue
                whole = whole_text(api, reply.json())
                path, body = real_body(api, model, prompt, seed + i, stream=True)
                try:
                    streamed = await streamed_text(http, api, path, body)
                except RuntimeError as e:
                    problems.append(f"{api} #{i}: {e}")
                    continue
                if streamed != whole or not whole:
                    problems.append(f"{api} #{i}: streamed {streamed!r} != non-streamed {whole!r}")
    return problems


# ---- the server: metrics and memory ------------------------------------------------------------


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS line")


def engine_gauges(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=10).text
    wanted = ("turbospark_running_sequences", "turbospark_waiting_sequences", "turbospark_kv_blocks_used")
    out = dict.fromkeys(wanted, float("nan"))
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def soak(args: argparse.Namespace, url: str, pid: int) -> tuple[Tally, int]:
    tally = Tally()
    start = time.monotonic()
    deadline = start + args.seconds
    limits = httpx.Limits(max_connections=args.clients * 2, max_keepalive_connections=args.clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(120)) as http:
        tasks = [
            asyncio.create_task(client(i, http, "scripted", deadline, tally, args.seed))
            for i in range(args.clients)
        ]
        await asyncio.sleep(min(args.warmup, args.seconds / 2))
        rss_warm = rss_kib(pid)
        while not all(t.done() for t in tasks):
            await asyncio.sleep(5)
            elapsed = time.monotonic() - start
            print(
                f"  {elapsed:5.0f} s  requests {sum(tally.by_api.values()):6d}  "
                f"rss {rss_kib(pid) / 1024:.1f} MiB  {dict(tally.kinds)}",
                flush=True,
            )
        await asyncio.gather(*tasks)
    return tally, rss_warm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=300.0)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--warmup", type=float, default=30.0, help="seconds before the first RSS reading")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds allowed for the queue to drain")
    ap.add_argument("--max-rss-growth", type=float, default=5.0, help="percent")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--real-model", default="smollm2", help="model for the stream == non-stream check, or none"
    )
    ap.add_argument("--real-requests", type=int, default=4, help="pairs per API on the real model")
    ap.add_argument("--url", help="soak a server already running here instead of starting one")
    ap.add_argument("--pid", type=int, help="with --url: the server's process id, for its RSS")
    args = ap.parse_args()
    if MIN_LIMIT + 2 * (args.clients - 1) <= len(REPLY):
        print("note: no client's limit exceeds the reply; stop-finished streams go unchecked")

    def settle_and_measure(url: str, pid: int) -> tuple[dict[str, float], int]:
        # Settle: the engine notices the last hang-ups on its next step.
        settle_end = time.monotonic() + args.settle
        gauges = engine_gauges(url)
        while any(v != 0 for v in gauges.values()) and time.monotonic() < settle_end:
            time.sleep(0.5)
            gauges = engine_gauges(url)
        return gauges, rss_kib(pid)

    print(f"host: {cpu_name()}, python {platform.python_version()}")
    if args.url:
        # A server someone else started (say, under a memory profiler): it must serve the
        # soak's reply as model "scripted"; it is neither started nor stopped here.
        if args.pid is None:
            ap.error("--url needs --pid (the server's process id, for its RSS)")
        print(f"soak: {args.clients} clients for {args.seconds:.0f} s against {args.url} (pid {args.pid})")
        tally, rss_warm = asyncio.run(soak(args, args.url, args.pid))
        gauges, rss_end = settle_and_measure(args.url, args.pid)
        log, status = "", None
    else:
        with tempfile.TemporaryDirectory() as tmp:
            reply_file = Path(tmp) / "reply.txt"
            reply_file.write_text(REPLY, encoding="utf-8")
            serve = ("--model", f"scripted:{reply_file}", "--max-active", "16", "--max-waiting", "256")
            print(f"soak: {args.clients} clients for {args.seconds:.0f} s against serve {' '.join(serve)}")
            with ServerProcess(*serve) as server:
                tally, rss_warm = asyncio.run(soak(args, server.url, server.proc.pid))
                gauges, rss_end = settle_and_measure(server.url, server.proc.pid)
                log = server.log()
                status = server.terminate()

    real_problems: list[str] = []
    if args.real_model != "none":
        print(f"\nreal model: serve --model {args.real_model}, {args.real_requests} request pairs per API")
        with ServerProcess("--model", args.real_model) as real:
            real_problems = asyncio.run(
                real_model_check(real.url, args.real_model, args.real_requests, args.seed)
            )
            real.terminate()

    growth = 100.0 * (rss_end - rss_warm) / rss_warm
    total = sum(tally.by_api.values())
    print("\n== soak summary ==")
    print(f"requests: {total} ({total / args.seconds:.1f}/s)")
    for api in APIS:
        parts = ", ".join(
            f"{k} {tally.by_api_kind[(api, k)]}" for k in ("completed", "disconnected", "error", "mismatch")
        )
        print(f"  {api:10s} {tally.by_api[api]:6d}: {parts}")
    print(
        f"completed {tally.kinds['completed']}, disconnected {tally.kinds['disconnected']} "
        f"({tally.early_disconnects} before the first byte), errors {tally.kinds['error']}, "
        f"mismatches {tally.kinds['mismatch']}"
    )
    for detail, count in tally.errors.most_common():
        print(f"  error {detail}: {count}")
    for example in tally.mismatch_examples:
        print(f"  mismatch: {example}")
    print("after settle: " + ", ".join(f"{k.removeprefix('turbospark_')} {v:g}" for k, v in gauges.items()))
    print(
        f"server RSS: {rss_warm / 1024:.1f} MiB at {args.warmup:.0f} s, "
        f"{rss_end / 1024:.1f} MiB at end, {growth:+.2f}%"
    )
    tracebacks = log.count("Traceback")
    if status is not None:
        print(f"server log: {tracebacks} tracebacks; exit status after SIGTERM {status}")
    if args.real_model != "none":
        pairs = args.real_requests * len(APIS)
        print(f"real model {args.real_model}: {pairs - len(real_problems)}/{pairs} streamed == non-streamed")
        for problem in real_problems:
            print(f"  {problem}")
    if tracebacks:
        first = log.index("Traceback")
        print(log[max(0, log.rfind("\n", 0, first - 200)) : first + 3000])

    failures = []
    if tally.kinds["error"]:
        failures.append("errors")
    if tally.kinds["mismatch"]:
        failures.append("mismatches")
    if tally.kinds["completed"] == 0:
        failures.append("nothing completed")
    if any(v != 0 for v in gauges.values()):
        failures.append("engine not idle after settle")
    if growth >= args.max_rss_growth:
        failures.append(f"RSS grew {growth:.2f}%")
    if tracebacks:
        failures.append("tracebacks in the server log")
    if real_problems:
        failures.append("streamed != non-streamed on the real model")
    print("RESULT: " + ("FAIL (" + ", ".join(failures) + ")" if failures else "PASS"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
