"""The CUDA decode attention kernel alone, at each context split: what `CudaAttention.num_splits`
should pick for a batch.

    python benchmarks/bench_paged_attention.py --seqs 1,16,64,256 --contexts 128,512,2048

One decode step of one layer with Llama-3.1-8B's shape by default (32 query heads, 8 key/value
heads of 128, bfloat16, pages of 16 tokens, each sequence's pages scattered over the cache): per
(sequences, context) the kernel's time (CUDA events over `--iters` calls after a warm-up, the
median of `--repeats` rounds) at each split of `--splits`, the split the heuristic picks marked
`*`, and the bytes of keys and values read per microsecond against the card's copy bandwidth
(a `torch` device-to-device copy of 1 GiB measured first). Every split's output is checked
against split 1's.
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from turbospark.engine.attention import build_attention_metadata
from turbospark.engine.cuda_attention import CudaAttention


def copy_bandwidth_gbs(device: torch.device) -> float:
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 10 / (start.elapsed_time(end) * 1e-3) / 1e9


def time_us(fn, iters: int, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", default="1,8,16,32,64,128,256")
    parser.add_argument("--contexts", default="128,256,512,1024,2048")
    parser.add_argument("--splits", default="1,2,4,8,16")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs")
    bw = copy_bandwidth_gbs(device)
    print(f"copy bandwidth {bw:.0f} GB/s; heads {args.heads}/{args.kv_heads} x {args.head_dim}, bfloat16")
    page = 16
    splits = [int(s) for s in args.splits.split(",")]
    print(
        f"{'seqs':>5} {'context':>8} "
        + "".join(f"{'split ' + str(s):>11}" for s in splits)
        + f"{'best':>6}{'% bw':>7}"
    )
    for num_seqs in (int(s) for s in args.seqs.split(",")):
        for ctx in (int(c) for c in args.contexts.split(",")):
            pages_per_seq = -(-ctx // page)
            num_pages = num_seqs * pages_per_seq + 1
            kc = torch.randn(
                args.kv_heads, num_pages * page, args.head_dim, device=device, dtype=torch.bfloat16
            )
            vc = torch.randn_like(kc)
            order = torch.randperm(num_pages - 1).add_(1).tolist()  # page 0 stays the padding page
            tables = [order[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(num_seqs)]
            meta, _ = build_attention_metadata(tables, [ctx - 1] * num_seqs, [1] * num_seqs, page, device)
            q = torch.randn(num_seqs, args.heads, args.head_dim, device=device, dtype=torch.bfloat16)
            attention = CudaAttention()
            picked = attention.num_splits(num_seqs, args.kv_heads, device)
            reference = None
            cells, times = [], {}
            call = functools.partial(attention.attend, q, kc, vc, meta, args.head_dim**-0.5)
            for s in splits:
                attention.num_splits = lambda *_a, s=s: s  # type: ignore[method-assign]
                out = call()
                if reference is None:
                    reference = out
                else:
                    torch.testing.assert_close(out, reference, atol=2e-2, rtol=2e-2)
                times[s] = time_us(call, args.iters, args.repeats)
                cells.append(f"{times[s]:>10.1f}{'*' if s == picked else ' '}")
            best = min(times, key=times.__getitem__)
            kv_bytes = 2 * num_seqs * ctx * args.kv_heads * args.head_dim * 2
            pct = kv_bytes / (times[best] * 1e-6) / (bw * 1e9) * 100
            print(f"{num_seqs:>5} {ctx:>8} " + "".join(cells) + f"{best:>6}{pct:>6.0f}%", flush=True)


if __name__ == "__main__":
    main()
