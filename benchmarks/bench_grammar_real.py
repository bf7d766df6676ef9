"""Cost of the grammar mask per decoded token on a real model: Qwen2.5-Coder-0.5B-Instruct.

The same prompt is decoded greedily twice, through the engine exactly as the server runs it
(`make_plan` -> `RealChatModel.run_completion`): once constrained by a json_schema response format
(the llguidance `GrammarProcessor` inside the decode loop), once unconstrained with no stop
tokens, for as many tokens as the constrained answer took. Per token it reports the time between
consecutive tokens (one model step + processors + sampler; the prefill is excluded) as the
median over the run's tokens, and for the constrained run the time spent inside the mask alone.
Runs alternate (unconstrained, constrained) `--repeat` times and the median over runs is kept, so
load from other work on a shared machine hits both sides alike. Last, the mask alone is replayed
over the constrained answer's tokens (advance the matcher, compute the mask, apply it to logits).

    PYTHONPATH=src python benchmarks/bench_grammar_real.py --threads 2 [--repeat 3]

The model must be pulled first (`turbospark pull qwen2.5-coder:0.5b`). Measured on a 2-core x86_64
CPU (shared, load average 2.7), torch 2.13 CPU, --threads 2, llguidance 1.9.1, 184 tokens:

    decode                                  ms/token
    unconstrained                               47.4
    json_schema (llguidance mask)               47.5
      of which the mask (in the loop)          0.486
    mask alone, replayed                       0.205
    ratio constrained / unconstrained: 1.003; mask share of a step: 1.03%

Grammar compile 3.0 ms per request (the token trie, once per model: 0.93 s).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from turbospark.api.openai import parse_chat_request
from turbospark.backend import NEVER_CANCEL, CompletionResult, GenerationConfig, TokenEvent
from turbospark.grammar import GrammarProcessor
from turbospark.plan import make_plan
from turbospark.registry import ModelRegistry

PROMPT = (
    "Describe today's weather in Paris as JSON: the city, the country, the temperature in "
    "Celsius, the conditions, the humidity in percent, the wind in km/h, and a forecast for the "
    "next three days (day name, high, low, conditions)."
)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "temperature_c": {"type": "number"},
        "conditions": {"type": "string"},
        "humidity_percent": {"type": "integer", "minimum": 0, "maximum": 100},
        "wind_kph": {"type": "number"},
        "forecast": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "day": {"type": "string"},
                    "high_c": {"type": "number"},
                    "low_c": {"type": "number"},
                    "conditions": {"type": "string"},
                },
                "required": ["day", "high_c", "low_c", "conditions"],
            },
            "minItems": 3,
            "maxItems": 3,
        },
    },
    "required": [
        "city",
        "country",
        "temperature_c",
        "conditions",
        "humidity_percent",
        "wind_kph",
        "forecast",
    ],
}


@dataclass
class Run:
    num_tokens: int
    ms_per_token: float  # median interval between consecutive tokens
    mask_ms_per_token: float  # constrained only: inside GrammarProcessor.__call__
    text: str
    token_ids: list[int]


class TimedMask:
    """Wraps the plan's GrammarProcessor and clocks each call."""

    def __init__(self, inner: GrammarProcessor) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, generated_ids: Sequence[int], logits: torch.Tensor) -> None:
        t0 = time.perf_counter()
        self.inner(generated_ids, logits)
        self.seconds += time.perf_counter() - t0
        self.calls += 1


def decode(backend: Any, prompt_ids: list[int], config: GenerationConfig) -> tuple[CompletionResult, float]:
    """(result, median seconds between consecutive tokens)."""
    stamps: list[float] = []

    def on_progress(_: TokenEvent) -> None:
        stamps.append(time.perf_counter())

    result = backend.run_completion(prompt_ids, config, None, NEVER_CANCEL, on_progress)
    return result, statistics.median(b - a for a, b in itertools.pairwise(stamps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder:0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from turbospark.engine.backend import load_backend

    t0 = time.perf_counter()
    backend = load_backend(args.model, progress=False)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s")
    registry = ModelRegistry()
    registry.add(backend)
    body: dict[str, Any] = {
        "model": backend.model_id,
        "messages": [{"role": "user", "content": PROMPT}],
        "temperature": 0,
        "max_tokens": args.max_tokens,
    }
    free_plan = make_plan(parse_chat_request(body)[0], registry)
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    t0 = time.perf_counter()
    make_plan(parse_chat_request({**body, "response_format": fmt})[0], registry)
    first_compile = time.perf_counter() - t0  # includes the once-per-model token trie
    t0 = time.perf_counter()
    grammar_plan = make_plan(parse_chat_request({**body, "response_format": fmt})[0], registry)
    compile_s = time.perf_counter() - t0
    assert free_plan.prompt_ids == grammar_plan.prompt_ids, "both runs must decode from the same prompt"
    prompt_ids = free_plan.prompt_ids

    free_runs: list[Run] = []
    grammar_runs: list[Run] = []
    for i in range(args.repeat + 1):  # the first round warms up and is dropped
        config = grammar_plan.config_for_choice(0)
        (mask,) = [p for p in config.processors if isinstance(p, GrammarProcessor)]
        timed = TimedMask(mask)
        config.processors = [timed if p is mask else p for p in config.processors]
        result, per_token = decode(backend, prompt_ids, config)
        n = len(result.token_ids)
        assert result.finish_reason.value == "stop", "the JSON did not finish within --max-tokens"
        text = backend.tokenizer.decode(result.token_ids)
        json.loads(text)
        grammar = Run(n, per_token * 1e3, timed.seconds / timed.calls * 1e3, text, result.token_ids)

        # unconstrained: no stop ids, so exactly as many tokens whatever the model writes
        config = GenerationConfig(max_new_tokens=n, temperature=0.0)
        result, per_token = decode(backend, prompt_ids, config)
        assert len(result.token_ids) == n
        free = Run(n, per_token * 1e3, 0.0, backend.tokenizer.decode(result.token_ids), result.token_ids)
        if i > 0:
            free_runs.append(free)
            grammar_runs.append(grammar)
        print(
            f"round {i}{' (warm-up)' if i == 0 else ''}: {n} tokens; unconstrained "
            f"{free.ms_per_token:.1f} ms/token, json_schema {grammar.ms_per_token:.1f} ms/token "
            f"(mask {grammar.mask_ms_per_token:.3f} ms)",
            flush=True,
        )

    # the mask alone, replayed over the constrained answer: no model noise in it
    answer_ids = grammar_runs[0].token_ids
    replay_config = grammar_plan.config_for_choice(0)
    (template,) = [p for p in replay_config.processors if isinstance(p, GrammarProcessor)]
    logits = torch.randn(backend.vocab_size, generator=torch.Generator().manual_seed(0))
    replays = []
    for _ in range(10):
        proc = template.fork()
        rows = [logits.clone() for _ in range(len(answer_ids) + 1)]
        t0 = time.perf_counter()
        for i, row in enumerate(rows):  # the last mask leaves only EOS
            proc(answer_ids[:i], row)
        replays.append((time.perf_counter() - t0) / len(rows))
    replay_ms = statistics.median(replays) * 1e3

    free_ms = statistics.median(r.ms_per_token for r in free_runs)
    grammar_ms = statistics.median(r.ms_per_token for r in grammar_runs)
    mask_ms = statistics.median(r.mask_ms_per_token for r in grammar_runs)
    print(
        f"\nhardware: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{args.threads} threads; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"model {args.model}; prompt {len(prompt_ids)} tokens; "
        f"{free_runs[0].num_tokens} tokens decoded greedily"
    )
    print(
        f"grammar compile per request {compile_s * 1e3:.1f} ms "
        f"(first request, with the token trie: {first_compile:.2f} s)"
    )
    print(f"{'decode':<38} {'ms/token':>9}")
    print(f"{'unconstrained':<38} {free_ms:>9.1f}")
    print(f"{'json_schema (llguidance mask)':<38} {grammar_ms:>9.1f}")
    print(f"{'  of which the mask (in the loop)':<38} {mask_ms:>9.3f}")
    print(f"{'mask alone, replayed':<38} {replay_ms:>9.3f}")
    print(
        f"ratio constrained / unconstrained: {grammar_ms / free_ms:.3f}; "
        f"mask share of a step: {mask_ms / free_ms:.2%}"
    )
    print(
        f"\nconstrained answer:\n{grammar_runs[0].text}\n\n"
        f"unconstrained answer (same length):\n{free_runs[0].text}"
    )


if __name__ == "__main__":
    main()
