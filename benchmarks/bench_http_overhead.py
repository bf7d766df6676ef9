"""Per-request and per-token overhead of the HTTP path, against a bare Starlette/uvicorn peer.

Both servers run as uvicorn subprocesses on loopback; an async httpx client drives them with the
same concurrency in the same run. turbospark serves the scripted backend (no model cost), so
what is measured is parsing, planning, the queue, the worker-thread hop, detokenizing and SSE
framing. The peer answers the same shapes with no work at all: the ratio is our overhead.

    python benchmarks/bench_http_overhead.py [--seconds 5] [--concurrency 8] [--tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

from turbospark.testing import free_port

ROOT = Path(__file__).resolve().parent.parent

PEER_APP = """
import orjson
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

TOKENS = int(__import__("os").environ["BENCH_TOKENS"])

async def chat(request):
    body = orjson.loads(await request.body())
    if not body.get("stream"):
        reply = orjson.dumps({"choices": [{"message": {"content": "x"}}]})
        return Response(reply, media_type="application/json")
    async def gen():
        for _ in range(TOKENS):
            yield b"data: " + orjson.dumps({"choices": [{"delta": {"content": "z"}}]}) + b"\\n\\n"
        yield b"data: [DONE]\\n\\n"
    return StreamingResponse(gen(), media_type="text/event-stream")

app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
"""


def start(cmd: list[str], env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json={"stream": False}, timeout=1)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server did not start: {cmd}")


async def drive(url: str, body: dict[str, object], seconds: float, concurrency: int) -> tuple[int, int]:
    """Returns (requests completed, SSE data lines received)."""
    stop_at = time.monotonic() + seconds
    done = 0
    lines = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def worker() -> None:
            nonlocal done, lines
            while time.monotonic() < stop_at:
                if body.get("stream"):
                    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                        async for line in resp.aiter_lines():
                            if line.startswith("data: {"):
                                lines += 1
                else:
                    resp = await client.post("/v1/chat/completions", json=body)
                    resp.raise_for_status()
                done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done, lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()

    env = {**os.environ, "BENCH_TOKENS": str(args.tokens), "PYTHONPATH": str(ROOT / "src")}
    reply_file = ROOT / "bench-out" / "reply.txt"
    reply_file.parent.mkdir(exist_ok=True)
    reply_file.write_text("z" * args.tokens)  # one byte-level token per character
    ours_port, peer_port = free_port(), free_port()
    ours = start(
        [
            sys.executable,
            "-m",
            "turbospark",
            "serve",
            "--model",
            f"scripted:{reply_file}",
            "--port",
            str(ours_port),
            "--max-active",
            str(args.concurrency),
            "--log-level",
            "warning",
        ],
        env,
        ours_port,
    )
    peer_file = ROOT / "bench-out" / "peer_app.py"
    peer_file.write_text(PEER_APP)
    peer = start(
        [sys.executable, "-m", "uvicorn", "peer_app:app", "--port", str(peer_port), "--log-level", "warning"],
        {**env, "PYTHONPATH": str(peer_file.parent)},
        peer_port,
    )
    try:
        rows = []
        for label, body in [
            (
                "requests/s (1-token reply)",
                {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
            ),
            (
                "streamed tokens/s",
                {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            ),
        ]:
            results = {}
            for name, port in [("turbospark", ours_port), ("bare starlette", peer_port)]:
                done, lines = asyncio.run(
                    drive(f"http://127.0.0.1:{port}", body, args.seconds, args.concurrency)
                )
                results[name] = (lines if body.get("stream") else done) / args.seconds
            rows.append((label, results["turbospark"], results["bare starlette"]))
        print(
            f"hardware: {platform.machine()} CPU, {os.cpu_count()} cores; python {platform.python_version()}"
        )
        print(
            f"concurrency {args.concurrency}, {args.seconds:.0f} s per cell, "
            f"stream reply {args.tokens} tokens"
        )
        print(f"{'metric':32} {'turbospark':>12} {'bare starlette':>15} {'ratio':>7}")
        for label, ours_v, peer_v in rows:
            print(f"{label:32} {ours_v:12.1f} {peer_v:15.1f} {ours_v / peer_v:7.2f}")
    finally:
        for proc in (ours, peer):
            proc.terminate()
            proc.wait(timeout=10)


if __name__ == "__main__":
    main()
