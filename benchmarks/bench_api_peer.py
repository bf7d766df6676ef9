"""Prefill and decode through the HTTP API, turbospark against llama.cpp's `llama-server`, on the
same GGUF with the same threads, same machine, same run.

    taskset -c 0,1 python benchmarks/bench_api_peer.py --llama-server PATH/llama-server \\
        --gguf smollm2.gguf --gguf qwen.gguf --threads 2 --rounds 5

Both servers start once per model with default flags (one turbospark server per `--variants`
set; llama-server with `-t`/`-tb` = `--threads`, one slot); run the command under `taskset` to give
both the same cores. Each round sends each server, in turn, one streamed greedy `/v1/completions`
request with the same text: a prompt of about `--prompt-tokens` tokens that starts with the
round's number, so no prefix cache holds it, and `max_tokens` = `--new-tokens`. Prefill rate =
prompt tokens / time to the first content chunk; decode rate = (completion tokens - 1) / (first
content chunk to last). Medians over the rounds, and the median of each round's ratio. Works on
a random-weight GGUF (`random_gguf.py`) as on a real one: speed does not depend on the weights'
values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from bench_engine_cpu import cpu_kind
from turbospark.testing import ServerProcess, free_port

PEER = "llama.cpp"
FILLER = (
    "The river bends twice before it reaches the old mill, where the water slows and the light "
    "falls through the willows onto stones that were laid by hand a long time ago. "
)


def prompt_text(round_no: int, words: int) -> str:
    text = f"Note {round_no} of the survey. "
    while len(text.split()) < words:
        text += FILLER
    return text


def one_request(
    url: str, model: str, text: str, new_tokens: int, extra: dict[str, object]
) -> dict[str, float]:
    body = {
        "model": model,
        "prompt": text,
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    stamps: list[float] = []
    usage: dict[str, int] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=900) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices", [])):
                stamps.append(time.perf_counter())
    tokens = usage.get("completion_tokens", len(stamps))
    if tokens < 2 or len(stamps) < 2:
        raise RuntimeError(f"{url}: the reply was too short to time ({tokens} tokens)")
    return {
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "tokens": tokens,
        "prefill": usage.get("prompt_tokens", 0) / (stamps[0] - start),
        "decode": (tokens - 1) / (stamps[-1] - stamps[0]),
    }


class LlamaServer:
    def __init__(self, binary: str, gguf: Path, threads: int) -> None:
        self.port = free_port()
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)  # noqa: SIM115
        cmd = [binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=self._log)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited:\n{Path(self._log.name).read_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        os.unlink(self._log.name)


def compare(gguf: Path, args: argparse.Namespace) -> None:
    words = int(args.prompt_tokens * 0.87)
    variants = [v.strip() for v in args.variants.split(";")]
    names = [f"turbospark {v}".strip() for v in variants]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in [*names, PEER]}
    peer = LlamaServer(args.llama_server, gguf, args.threads)
    ours = [ServerProcess("--model", str(gguf), *v.split()) for v in variants]
    try:
        for server in ours:
            server.wait_healthy(timeout=600)
        peer.wait_healthy()
        servers = {name: (s.url, {}) for name, s in zip(names, ours, strict=True)}
        servers[PEER] = (peer.url, {"ignore_eos": True})  # random weights may pick the end token
        model = httpx.get(ours[0].url + "/v1/models").json()["data"][0]["id"]
        for url, extra in servers.values():  # warm-up: first calls allocate
            one_request(url, model, prompt_text(-1, 64), 8, extra)
        for r in range(args.rounds):
            for name, (url, extra) in servers.items():
                rows[name].append(one_request(url, model, prompt_text(r, words), args.new_tokens, extra))
    finally:
        peer.close()
        for server in ours:
            server.__exit__(None, None, None)
    shape = f"~{args.prompt_tokens}-token prompt, {args.new_tokens} new tokens"
    print(f"\n{gguf.name}: {args.rounds} rounds, {shape}")
    for name, got in rows.items():
        pre = statistics.median(g["prefill"] for g in got)
        dec = statistics.median(g["decode"] for g in got)
        seen = sorted({int(g["prompt_tokens"]) for g in got}), sorted({int(g["tokens"]) for g in got})
        print(f"  {name:<40} prefill {pre:8.1f} tok/s  decode {dec:7.1f} tok/s  (prompt, new tokens: {seen})")
    for name in names:
        for key in ("prefill", "decode"):
            ratios = [a[key] / b[key] for a, b in zip(rows[name], rows[PEER], strict=True)]
            print(
                f"  {name}: {key} / llama.cpp's, median of rounds {statistics.median(ratios):.2f}x "
                f"({', '.join(f'{x:.2f}' for x in ratios)})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--llama-server", required=True, help="the llama-server binary")
    parser.add_argument("--gguf", type=Path, action="append", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--variants",
        default="",
        help="`turbospark serve` flag sets to compare, ';' between sets (default: one server, default flags)",
    )
    args = parser.parse_args()
    print(cpu_kind())
    print(f"cores allowed: {len(os.sched_getaffinity(0))}, threads {args.threads}")
    for gguf in args.gguf:
        compare(gguf, args)


if __name__ == "__main__":
    main()
