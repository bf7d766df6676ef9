"""The batched sampler alone: per-call wall time of `sampling.sample_batch`, the call a decode
step makes after the forward, over (rows, vocab) logits on one device.

    PYTHONPATH=src python benchmarks/bench_sampler.py --device cuda
    PYTHONPATH=src python benchmarks/bench_sampler.py --device cuda --dtype float32,bfloat16 \\
        --tokens-out tokens.json --result-json sampler.json

Every row samples with the settings `bench_serving.py`'s requests get from `serve` (temperature
0.7 over the built-in top-k 40, top-p 0.95, min-p 0.05; the loop guard of `serve`'s default
window), each from its own seeded generator, as the engine's sequences do. Logits are random
normal times `--scale` (a few dozen tokens survive the filters). A call is timed from before
`sample_batch` to its return, which reads the tokens back to the host (one sync), after a
device sync; printed: mean, p50 and p90 in microseconds, and for scale `torch.topk` of the raw
logits alone. `--tokens-out` writes the tokens the first call picks with generators seeded
0..rows-1, so two trees can be checked for the same draws.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

import torch

from turbospark.backend import GenerationConfig
from turbospark.sampling import DistinctIds, LoopGuard, make_generator, sample_batch


@dataclass
class Row:
    """One sequence as `sample_batch` reads it (the engine's `Sequence`, sampling fields only)."""

    config: GenerationConfig
    generator: torch.Generator
    token_ids: list[int]
    num_prompt_tokens: int
    distinct_ids: DistinctIds = field(default_factory=DistinctIds)
    loop_guard: LoopGuard | None = None

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


def make_rows(args: argparse.Namespace, vocab: int) -> list[Row]:
    ids = torch.Generator().manual_seed(1)
    rows = []
    for i in range(args.rows):
        config = GenerationConfig(
            max_new_tokens=256,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            loop_window=args.loop_guard,
        )
        tokens = torch.randint(0, vocab, (64 + 100,), generator=ids).tolist()
        rows.append(Row(config, make_generator(i), tokens, 64, loop_guard=LoopGuard(args.loop_guard)))
    return rows


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: object, device: torch.device, iters: int, warmup: int) -> list[float]:
    assert callable(fn)
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        out.append((time.perf_counter() - start) * 1e6)
    return out


def summary(us: list[float]) -> dict[str, float]:
    us = sorted(us)
    return {
        "mean_us": statistics.fmean(us),
        "p50_us": us[len(us) // 2],
        "p90_us": us[int(len(us) * 0.9)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=128_256)  # Llama-3.1's
    p.add_argument("--dtype", default="float32", help="comma-separated: float32, bfloat16")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--loop-guard", type=int, default=256, help="window (serve's default is 256)")
    p.add_argument("--scale", type=float, default=3.0)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--tokens-out", default=None)
    p.add_argument("--result-json", default=None)
    args = p.parse_args()
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(args.rows, args.vocab, generator=gen) * args.scale
    results: dict[str, object] = {"rows": args.rows, "vocab": args.vocab}
    tokens: dict[str, list[int]] = {}
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        logits = base.to(device, dtype)
        first = sample_batch(logits, make_rows(args, args.vocab))
        tokens[name] = [e.token_id for e in first]  # type: ignore[union-attr]
        rows = make_rows(args, args.vocab)
        call = summary(timed(lambda: sample_batch(logits, rows), device, args.iters, args.warmup))  # noqa: B023
        topk = summary(timed(lambda: torch.topk(logits, args.top_k, dim=-1), device, args.iters, args.warmup))  # noqa: B023
        results[name] = {"sample_batch": call, "topk_raw": topk}
        print(
            f"{name}: sample_batch {call['mean_us']:.0f} us mean, {call['p50_us']:.0f} p50, "
            f"{call['p90_us']:.0f} p90 ({args.rows} x {args.vocab}); "
            f"torch.topk {args.top_k} of the raw logits alone {topk['mean_us']:.0f} us"
        )
    if args.tokens_out:
        with open(args.tokens_out, "w") as f:
            json.dump(tokens, f)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
