"""Replays a recorded Claude Code session against a served model; llama.cpp prefill beside it.

The session (benchmarks/data/claude_code_session.json, made by record_claude_session.py) holds
Claude Code's real /v1/messages bodies: the first turn, the follow-up carrying a Bash
tool_result, and a second user turn. Each is sent in order, as recorded, as a streaming POST
with only `model`, `max_tokens` (bounded, --max-tokens) and `stream` replaced. Per request:

- prompt tokens (the server's count for the body, from /v1/messages/count_tokens; else the
  message_start usage summed the Anthropic way: input + cache read + cache creation),
- cached tokens (`cache_read_input_tokens` from message_start / message_delta usage; 0 if absent),
- TTFT: send to the first content_block_delta (message_start and pings do not count: Claude Code
  gives up when no content chunk arrives within 300 s),
- decode tokens/s (output tokens after the first, over the time from first to last delta),
- wall time.

Beside it, in the same run, llama.cpp (llama-cpp-python) prefills the same token counts from
the same GGUF with the same number of threads: each prompt from an empty cache ("cold"), and
the session in order keeping the KV cache of the previous request and evaluating only the part
after the common prefix, as llama-server's slot cache does ("reuse"). The tokens are the
prompts as turbospark renders them with the GGUF's own tokenizer and chat template, cut or
extended to the count the server reported so both sides prefill the same number of tokens.

Start the server yourself, or let --serve start one on a free loopback port:

    turbospark serve --model qwen2.5-coder:0.5b --max-context 32768 &
    python benchmarks/bench_agent.py --base-url http://127.0.0.1:8000 --model qwen2.5-coder:0.5b
    python benchmarks/bench_agent.py --serve "--model qwen2.5-coder:0.5b --max-context 32768" \\
        --only 1 --json out.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from turbospark.testing import free_port

DEFAULT_DATA = Path(__file__).resolve().parent / "data" / "claude_code_session.json"
CLAUDE_PREFIX = "claude-turbospark-"


@dataclass
class Row:
    label: str
    status: int | None = None
    prompt_tokens: int | None = None
    input_tokens: int | None = None  # message_start usage as sent
    cached_tokens: int = 0
    output_tokens: int = 0
    start_s: float | None = None  # to message_start: the request was accepted
    ttft_s: float | None = None
    decode_tps: float | None = None
    wall_s: float | None = None
    stop_reason: str | None = None
    error: str | None = None
    llama_tokens: int | None = None
    llama_cold_s: float | None = None
    llama_reuse_s: float | None = None
    llama_reused_tokens: int | None = None
    text: str = field(default="", repr=False)


def cpu_description() -> str:
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name}, {os.cpu_count()} logical CPUs, flags: {' '.join(simd) or 'none of avx2/avx512'}"


# ---------------------------------------------------------------- the server side


def start_server(serve_args: str, timeout: float, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "turbospark", "serve", *shlex.split(serve_args)]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    print(f"starting: {shlex.join(cmd)}  (log: {log_path})", flush=True)
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s:\n{log_path.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def headers(api_key: str) -> dict[str, str]:
    return {"x-api-key": api_key, "anthropic-version": "2023-06-01", "content-type": "application/json"}


def first_model(client: httpx.Client, url: str, api_key: str) -> str:
    resp = client.get(f"{url}/v1/models", headers=headers(api_key))
    resp.raise_for_status()
    models = resp.json()["data"]
    if not models:
        raise SystemExit("the server lists no models; pass --model")
    return str(models[0]["id"])


def count_tokens(client: httpx.Client, url: str, api_key: str, body: dict[str, Any]) -> int | None:
    counted = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
    resp = client.post(f"{url}/v1/messages/count_tokens", headers=headers(api_key), json=counted)
    if resp.status_code != 200:
        print(f"  count_tokens answered {resp.status_code}: {resp.text[:500]}", flush=True)
        return None
    return int(resp.json()["input_tokens"])


def usage_into(row: Row, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    if usage.get("input_tokens") is not None:
        row.input_tokens = int(usage["input_tokens"])
    if usage.get("cache_read_input_tokens") is not None:
        row.cached_tokens = int(usage["cache_read_input_tokens"])
    if usage.get("output_tokens") is not None:
        row.output_tokens = int(usage["output_tokens"])


def replay_one(
    client: httpx.Client, url: str, api_key: str, body: dict[str, Any], row: Row, limit: float
) -> None:
    """One streaming POST /v1/messages; fills row (an error is recorded, not raised).

    Gives up (closing the stream, which cancels the generation) after `limit` seconds in all:
    the server's pings keep a plain read timeout from ever firing.
    """
    start = time.perf_counter()
    first_delta = last_delta = None
    usage_start: dict[str, Any] = {}
    parts: list[str] = []
    try:
        with client.stream("POST", f"{url}/v1/messages", headers=headers(api_key), json=body) as resp:
            row.status = resp.status_code
            if resp.status_code != 200:
                resp.read()
                row.error = f"HTTP {resp.status_code}: {resp.text[:2000]}"
                return
            event = None
            for line in resp.iter_lines():
                if time.perf_counter() - start > limit:
                    where = "no content yet" if first_delta is None else "decoding"
                    row.error = f"gave up after {limit:.0f} s ({where})"
                    break
                if line.startswith("event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith("data:"):
                    continue
                data = json.loads(line[5:])
                kind = data.get("type", event)
                if kind == "message_start":
                    row.start_s = time.perf_counter() - start
                    usage_start = data["message"].get("usage") or {}
                    usage_into(row, usage_start)
                elif kind == "content_block_delta":
                    now = time.perf_counter()
                    first_delta = first_delta or now
                    last_delta = now
                    delta = data.get("delta", {})
                    parts.append(
                        delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
                    )
                elif kind == "message_delta":
                    usage_into(row, data.get("usage"))
                    row.stop_reason = (data.get("delta") or {}).get("stop_reason")
                elif kind == "error":
                    row.error = f"stream error event: {json.dumps(data)[:2000]}"
    except httpx.HTTPError as exc:
        row.error = f"{type(exc).__name__}: {exc}"
    finally:
        row.wall_s = time.perf_counter() - start
        row.text = "".join(parts)
        if first_delta is not None:
            row.ttft_s = first_delta - start
            if last_delta is not None and row.output_tokens > 1 and last_delta > first_delta:
                row.decode_tps = (row.output_tokens - 1) / (last_delta - first_delta)
    if row.prompt_tokens is None and row.input_tokens is not None:
        creation = int(usage_start.get("cache_creation_input_tokens") or 0)
        row.prompt_tokens = row.input_tokens + row.cached_tokens + creation


# ---------------------------------------------------------------- llama.cpp


def gguf_for(model: str, explicit: Path | None) -> Path | None:
    if explicit is not None:
        return explicit
    from turbospark.engine.loader import resolve_model_spec

    name = model.removeprefix(CLAUDE_PREFIX)
    try:
        kind, path = resolve_model_spec(name)
    except Exception:
        return None
    return path if kind == "gguf" and path.is_file() else None


def render_prompts(gguf: Path, bodies: list[dict[str, Any]]) -> list[list[int]] | None:
    """Each body's prompt ids as turbospark renders it with the GGUF's tokenizer and template."""
    try:
        from turbospark.api.anthropic import parse_messages_request
        from turbospark.engine.gguf_file import GGUFFile
        from turbospark.engine.gguf_tokenizer import load_gguf_tokenizer
        from turbospark.plan import make_plan
        from turbospark.registry import ModelRegistry
        from turbospark.scripted import ScriptedChatModel
        from turbospark.tokenizer import Tokenizer

        hf, config = load_gguf_tokenizer(GGUFFile(gguf))
        registry = ModelRegistry()
        registry.add(
            ScriptedChatModel(["."], model_id="render", tokenizer=Tokenizer(hf, config), max_context=1 << 22)
        )
        out = []
        for body in bodies:
            parsed = parse_messages_request({**body, "model": "render"})
            out.append(list(make_plan(parsed, registry).prompt_ids))
        return out
    except Exception as exc:  # a benchmark aid: fall back to the body's own text
        print(
            f"  could not render the prompts with {gguf.name}'s template ({exc}); using body text", flush=True
        )
        return None


def fit(ids: list[int], n: int) -> list[int]:
    """ids cut or cyclically extended to n tokens (prefill cost depends on the count, not the ids)."""
    if len(ids) >= n:
        return ids[:n]
    return [ids[i % len(ids)] for i in range(n)]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run_llama(gguf: Path, prompts: list[list[int]], rows: list[Row], threads: int, modes: set[str]) -> str:
    from llama_cpp import Llama, __version__

    n_ctx = max(len(p) for p in prompts) + 16
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.eval(prompts[0][:8])  # warm-up: the first decode allocates the compute graph
    if "cold" in modes:
        for ids, row in zip(prompts, rows, strict=True):
            llm.n_tokens = 0  # eval() drops every cached position from here on
            start = time.perf_counter()
            llm.eval(ids)
            row.llama_cold_s = time.perf_counter() - start
            print(
                f"  llama.cpp cold   {row.label:<22} {len(ids):>6} tokens {row.llama_cold_s:8.1f} s",
                flush=True,
            )
    if "reuse" in modes:
        llm.n_tokens = 0
        previous: list[int] = []
        for ids, row in zip(prompts, rows, strict=True):
            keep = min(common_prefix(previous, ids), len(ids) - 1)  # at least one token is evaluated
            llm.n_tokens = keep  # eval() drops the cached positions from here on, keeps the prefix
            start = time.perf_counter()
            llm.eval(ids[keep:])
            row.llama_reuse_s = time.perf_counter() - start
            row.llama_reused_tokens = keep
            previous = ids
            print(
                f"  llama.cpp reuse  {row.label:<22} {len(ids):>6} tokens ({keep} kept) "
                f"{row.llama_reuse_s:8.1f} s",
                flush=True,
            )
    return f"llama-cpp-python {__version__}, n_ctx {n_ctx}, {threads} threads"


# ---------------------------------------------------------------- report


def fmt(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'request':<22} {'status':>6} {'prompt':>7} {'cached':>7} {'TTFT s':>8} {'dec tok/s':>9} "
        f"{'out':>4} {'wall s':>8} | {'llama cold s':>12} {'llama reuse s':>13} {'kept':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.label:<22} {fmt(r.status, 'd'):>6} {fmt(r.prompt_tokens, 'd'):>7} {r.cached_tokens:>7} "
            f"{fmt(r.ttft_s, '.2f'):>8} {fmt(r.decode_tps, '.1f'):>9} {r.output_tokens:>4} "
            f"{fmt(r.wall_s, '.2f'):>8} | {fmt(r.llama_cold_s, '.1f'):>12} {fmt(r.llama_reuse_s, '.1f'):>13} "
            f"{fmt(r.llama_reused_tokens, 'd'):>6}"
        )
    for r in rows:
        if r.prompt_tokens and r.ttft_s and r.llama_cold_s:
            print(
                f"{r.label}: turbospark TTFT {r.ttft_s:.1f} s vs llama.cpp cold prefill "
                f"{r.llama_cold_s:.1f} s ({r.prompt_tokens / r.ttft_s:.0f} vs "
                f"{r.prompt_tokens / r.llama_cold_s:.0f} prompt tok/s)"
            )


def replay(
    args: argparse.Namespace, url: str, records: list[dict[str, Any]]
) -> tuple[str, list[Row], list[Any]]:
    """(model id, one row per request, the bodies as sent)."""
    rows: list[Row] = []
    bodies: list[dict[str, Any]] = []
    timeout = httpx.Timeout(args.timeout, connect=args.connect_timeout)
    with httpx.Client(timeout=timeout) as client:
        model = args.model or first_model(client, url, args.api_key)
        print(f"server: {url}, model {model!r}", flush=True)
        for record in records:
            body = copy.deepcopy(record["body"])
            body.update(model=model, max_tokens=args.max_tokens, stream=True)
            bodies.append(body)
            row = Row(label=record["label"])
            if not args.no_count:
                row.prompt_tokens = count_tokens(client, url, args.api_key, body)
            print(f"> {row.label} (prompt {fmt(row.prompt_tokens, 'd')} tokens) ...", flush=True)
            replay_one(client, url, args.api_key, body, row, args.timeout)
            rows.append(row)
            if row.error:
                print(f"  FAILED: {row.error} (message_start after {fmt(row.start_s, '.2f')} s)", flush=True)
                continue
            print(
                f"  message_start {fmt(row.start_s, '.2f')} s, TTFT {fmt(row.ttft_s, '.2f')} s, "
                f"cached {row.cached_tokens}, {row.output_tokens} out, wall {fmt(row.wall_s, '.2f')} s, "
                f"stop {row.stop_reason}: {row.text[:80]!r}",
                flush=True,
            )
    return model, rows, bodies


def llama_side(args: argparse.Namespace, model: str, rows: list[Row], bodies: list[dict[str, Any]]) -> str:
    """Runs the llama.cpp passes asked for; returns a line describing what ran (or why not)."""
    modes = {m for m in args.llama.split(",") if m and m != "none"}
    if not modes:
        return "llama.cpp: not run"
    counts = [r.prompt_tokens for r in rows]
    if not all(counts):
        return "llama.cpp: skipped (a request has no prompt token count)"
    try:
        from llama_cpp import Llama
    except ImportError:
        return "llama.cpp: skipped (llama_cpp is not importable)"
    gguf = gguf_for(model, args.gguf)
    if gguf is None:
        return f"llama.cpp: skipped (no GGUF for {model!r}; pass --gguf)"
    print(f"llama.cpp on {gguf.name} ...", flush=True)
    rendered = render_prompts(gguf, bodies)
    if rendered is None:
        vocab = Llama(model_path=str(gguf), vocab_only=True, verbose=False)
        rendered = [vocab.tokenize(json.dumps(b).encode(), add_bos=False) for b in bodies]
    for r, ids in zip(rows, rendered, strict=True):
        print(f"  {r.label}: rendered {len(ids)} tokens, the server counted {r.prompt_tokens}", flush=True)
    if any(len(ids) != n for ids, n in zip(rendered, counts, strict=True)):
        print(
            "  the served model renders other token counts than this GGUF: llama.cpp prefills the "
            "server's counts, but its kept-prefix column then says little",
            flush=True,
        )
    prompts = [fit(ids, int(n or 0)) for ids, n in zip(rendered, counts, strict=True)]
    for r, ids in zip(rows, prompts, strict=True):
        r.llama_tokens = len(ids)
    return run_llama(gguf, prompts, rows, args.threads, modes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="recorded session (list of {label, body})")
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="a running server (ignored with --serve)"
    )
    p.add_argument("--serve", metavar="ARGS", help="start `turbospark serve ARGS` on a free loopback port")
    p.add_argument("--serve-timeout", type=float, default=900, help="seconds to wait for /health")
    p.add_argument("--model", help="model id to send (default: the first one /v1/models lists)")
    p.add_argument("--api-key", default="dummy")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens sent with every request")
    p.add_argument("--only", type=int, help="replay only the first N requests")
    p.add_argument(
        "--timeout", type=float, default=1800, help="give up on a request after this many seconds in all"
    )
    p.add_argument("--connect-timeout", type=float, default=10)
    p.add_argument("--no-count", action="store_true", help="skip /v1/messages/count_tokens")
    p.add_argument("--llama", default="cold,reuse", help="llama.cpp passes: cold,reuse | cold | reuse | none")
    p.add_argument("--gguf", type=Path, help="GGUF for llama.cpp (default: the served model's, if pulled)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()

    records = json.loads(args.data.read_text(encoding="utf-8"))
    if args.only is not None:
        records = records[: args.only]
    print(f"CPU: {cpu_description()}")
    print(f"session: {args.data.name}, {len(records)} requests, max_tokens {args.max_tokens}", flush=True)

    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        proc, url = None, args.base_url.rstrip("/")
        log = Path(tmp) / "serve.log"
        if args.serve:
            proc, url = start_server(args.serve, args.serve_timeout, log)
        failed = True
        try:
            model, rows, bodies = replay(args, url, records)
            failed = any(r.error for r in rows)
        finally:
            if proc is not None:
                stop_server(proc)
                if failed:
                    print(f"server log tail:\n{log.read_text(errors='replace')[-3000:]}")

    llama_info = llama_side(args, model, rows, bodies)
    print()
    print(f"CPU: {cpu_description()}")
    print(f"turbospark at {url}, model {model!r}; {llama_info}")
    print_table(rows)
    if args.json:
        out = {
            "cpu": cpu_description(),
            "model": model,
            "serve": args.serve,
            "max_tokens": args.max_tokens,
            "llama": llama_info,
            "requests": [asdict(r) for r in rows],
        }
        args.json.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if any(r.error for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
