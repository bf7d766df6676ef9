"""Single-stream decode rate through the HTTP API against the engine's own, same machine, same run.

The engine side is `bench_engine_cpu.py`'s (the model built as the server builds it, greedy,
decode timed after a prompt of `--prompt-tokens`). The HTTP side is `turbospark serve --model M`
with default flags in a subprocess: one streamed `/v1/chat/completions` request at a time,
greedy, a prompt of about the same length, `max_tokens` = `--new-tokens`; its decode rate is
(completion tokens - 1) / (time from the first content chunk to the last). The two alternate
`--rounds` times (the server idles while the engine runs and the other way round), and medians
are reported with their ratio, and the median of each round's ratio (the speed of a shared
machine drifts between rounds): the issue's target is HTTP >= 95% of the engine.

    python benchmarks/bench_http_decode.py --model smollm2 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics

import torch

from bench_api_peer import one_request
from bench_engine_cpu import cpu_kind, prompt_ids, turbospark_engine
from turbospark.engine.cpu_kernels import cpu_kernels
from turbospark.engine.loader import load_checkpoint
from turbospark.testing import ServerProcess


def http_decode(url: str, model: str, text: str, new_tokens: int) -> tuple[float, int]:
    """(decode tokens/s, completion tokens) of one streamed greedy request: a text completion,
    which continues the prompt (a chat reply may end long before `new_tokens`)."""
    got = one_request(url, model, text, new_tokens, {})
    return got["decode"], int(got["tokens"])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(cpu_kind())
    print(cpu_kernels().describe())
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    ckpt = load_checkpoint(args.model, progress=False)
    ids = prompt_ids(lambda t: ckpt.tokenizer.encode(t).ids, args.prompt_tokens)
    max_len = args.prompt_tokens + args.new_tokens + 64
    decode_context = args.prompt_tokens + args.new_tokens // 2
    engine = turbospark_engine(ckpt.config, dict(ckpt.tensors), max_len, 1.0, decode_context)
    text = ckpt.tokenizer.decode(ids)  # the same prompt, as text
    engine_rates, http_rates, lengths = [], [], []
    with ServerProcess("--model", args.model) as server:
        server.wait_healthy(timeout=600)
        http_decode(server.url, args.model, text, 8)  # warm-up: first calls allocate
        engine.decode(ids[:64], 8)
        for _ in range(args.rounds):
            engine_rates.append(args.new_tokens / engine.decode(ids, args.new_tokens))
            rate, n = http_decode(server.url, args.model, text, args.new_tokens)
            http_rates.append(rate)
            lengths.append(n)
    med_engine, med_http = statistics.median(engine_rates), statistics.median(http_rates)
    print(f"\n{args.model}, decode after ~{args.prompt_tokens} prompt tokens, {args.rounds} rounds")
    print(f"engine  {med_engine:6.1f} tok/s  (rounds: {', '.join(f'{r:.1f}' for r in engine_rates)})")
    http_rounds = ", ".join(f"{r:.1f}" for r in http_rates)
    print(f"HTTP    {med_http:6.1f} tok/s  (rounds: {http_rounds}; tokens {lengths})")
    print(f"HTTP / engine: {med_http / med_engine:.1%} (medians)")
    # the machine's speed drifts: each HTTP round against the engine round just before it
    paired = [h / e for h, e in zip(http_rates, engine_rates, strict=True)]
    print(f"HTTP / engine, median of the rounds' ratios: {statistics.median(paired):.1%}")


if __name__ == "__main__":
    main()
