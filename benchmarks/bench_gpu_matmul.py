"""Small-batch matmuls on the GPU: the engine's GEMV kernels against cuBLAS, on real layer shapes.

    python benchmarks/bench_gpu_matmul.py [--sweep] [--json out.json]

For each linear of Qwen2.5-0.5B and Llama-3.1-8B (q/k/v fused, o, gate/up fused, down,
lm_head) and M = 1, 2, 4 rows: time per call of `F.linear` (cuBLAS) and of `cuda_ops.gemv`
(the block sizes `gemv_blocks` picks), as the engine runs them: inside a CUDA graph, each call
on a different copy of the weight so that the weights come from HBM, not from L2 (copies until
they pass 256 MB). Also the fused kernels against what they replace: `gate_up_silu` against
cuBLAS + `silu_mul`, `qkv_rotary` against cuBLAS + `rotary`, and each with the RMSNorm inside
(`cuda_ops.Norm`) against the norm kernel before it. `--sweep` also times every
(BLOCK_N, BLOCK_K, num_warps) of a grid at M = 1 and prints the best per shape.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from turbospark.engine import cuda_ops, triton_kernels

DEVICE = torch.device("cuda")
L2_BYTES = 256 << 20


def shapes() -> list[tuple[str, str, int, int, bool]]:
    """(model, layer, N, K, bias) of every distinct linear."""
    from bench_gpu import CONFIGS

    out = []
    for name, c in CONFIGS.items():
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        head_dim = c["hidden_size"] // heads
        hidden, inter = c["hidden_size"], c["intermediate_size"]
        bias = c["model_type"] == "qwen2"
        out += [
            (name, "qkv", (heads + 2 * kv) * head_dim, hidden, bias),
            (name, "o", hidden, heads * head_dim, False),
            (name, "gate_up", 2 * inter, hidden, False),
            (name, "down", hidden, inter, False),
            (name, "lm_head", c["vocab_size"], hidden, False),
        ]
    return out


def time_calls(fn: Callable[[int], Any], copies: int, reps: int = 3) -> float:
    """Seconds per call of fn(i) (i cycling over the weight copies), replayed from a graph."""
    calls = max(copies, 16)
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(min(calls, 3)):
            fn(i % copies)  # compile, library handles
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    del graph
    return best


def launch_gemv(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, bn: int, bk: int, warps: int
) -> None:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    triton_kernels.gemv_kernel[(triton_cdiv(n, bn),)](
        x, w, b if b is not None else w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=b is not None, BLOCK_M=cuda_ops._pow2(m), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
    )  # fmt: skip


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def sweep(x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor] | None) -> list[dict[str, Any]]:
    """Every (BLOCK_N, BLOCK_K, num_warps) of the grid on this shape, fastest first."""
    k = x.shape[1]
    results = []
    for bk in (256, 512, 1024, 2048, 4096):
        if bk > 2 * cuda_ops._pow2(k):
            continue
        for bn in (1, 2, 4, 8, 16, 32):
            if not 512 <= bn * bk <= 65536:
                continue
            for warps in (4, 8):

                def call(i: int, bn: int = bn, bk: int = bk, warps: int = warps) -> None:
                    launch_gemv(x, ws[i], bs[i] if bs is not None else None, bn, bk, warps)

                try:
                    t = time_calls(call, len(ws))
                except Exception as exc:  # a config that does not compile: skip it
                    print(f"    ({bn}, {bk}, {warps}) failed: {type(exc).__name__}")
                    continue
                results.append({"us": t * 1e6, "block_n": bn, "block_k": bk, "warps": warps})
    return sorted(results, key=lambda r: r["us"])


def bench_one(
    model: str, layer: str, m: int, ws: list[torch.Tensor], bs: list[torch.Tensor] | None, do_sweep: bool
) -> dict[str, Any]:
    n, k = ws[0].shape
    copies = len(ws)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)

    def b_of(i: int) -> torch.Tensor | None:
        return bs[i] if bs is not None else None

    t_cublas = time_calls(lambda i: F.linear(x, ws[i], b_of(i)), copies)
    t_gemv = time_calls(lambda i: cuda_ops.gemv(x, ws[i], b_of(i)), copies)
    row: dict[str, Any] = {
        "model": model, "layer": layer, "n": n, "k": k, "m": m,
        "cublas_us": t_cublas * 1e6, "gemv_us": t_gemv * 1e6,
        "blocks": cuda_ops.gemv_blocks(n, k, DEVICE),
    }  # fmt: skip
    res = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    norm_w = torch.ones(k, device=DEVICE, dtype=torch.bfloat16)
    norm = cuda_ops.Norm(norm_w, 1e-6, res)
    if layer == "gate_up":
        t_ref = time_calls(lambda i: cuda_ops.silu_mul(F.linear(x, ws[i]), n // 2), copies)
        t_fused = time_calls(lambda i: cuda_ops.gate_up_silu(x, ws[i], None), copies)
        row["unfused_us"], row["fused_us"] = t_ref * 1e6, t_fused * 1e6
        t_norm_ref = time_calls(
            lambda i: cuda_ops.gate_up_silu(cuda_ops.rms_norm(x, norm_w, 1e-6, res)[0], ws[i], None), copies
        )
        t_norm = time_calls(lambda i: cuda_ops.gate_up_silu(x, ws[i], None, norm), copies)
        row["norm_then_fused_us"], row["norm_inside_us"] = t_norm_ref * 1e6, t_norm * 1e6
    if layer == "qkv":
        from bench_gpu import CONFIGS

        c = CONFIGS[model]
        heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
        d = c["hidden_size"] // heads
        cos = torch.randn(m, 1, d, device=DEVICE, dtype=torch.bfloat16)
        sin = torch.randn(m, 1, d, device=DEVICE, dtype=torch.bfloat16)

        def unfused(i: int) -> None:
            qkv = F.linear(x, ws[i], b_of(i)).view(m, -1, d)
            cuda_ops.rotary(qkv[:, : heads + kv], cos, sin)

        t_ref = time_calls(unfused, copies)
        t_fused = time_calls(
            lambda i: cuda_ops.qkv_rotary(x, ws[i], b_of(i), cos, sin, heads + kv, d), copies
        )
        row["unfused_us"], row["fused_us"] = t_ref * 1e6, t_fused * 1e6

        def norm_then(i: int) -> None:
            normed = cuda_ops.rms_norm(x, norm_w, 1e-6, res)[0]
            cuda_ops.qkv_rotary(normed, ws[i], b_of(i), cos, sin, heads + kv, d)

        t_norm_ref = time_calls(norm_then, copies)
        t_norm = time_calls(
            lambda i: cuda_ops.qkv_rotary(x, ws[i], b_of(i), cos, sin, heads + kv, d, norm), copies
        )
        row["norm_then_fused_us"], row["norm_inside_us"] = t_norm_ref * 1e6, t_norm * 1e6
    nbytes = n * k * 2
    fused = ""
    if "fused_us" in row:
        fused = (
            f"  fused {row['fused_us']:.1f} vs {row['unfused_us']:.1f} us; with the norm inside "
            f"{row['norm_inside_us']:.1f} vs {row['norm_then_fused_us']:.1f} us"
        )
    print(
        f"{model + ' ' + layer:<28}{m:>3}{nbytes / 1e6:>8.1f}{t_cublas * 1e6:>11.1f}{t_gemv * 1e6:>9.1f}"
        f"{nbytes / t_cublas / 1e9:>7.0f}/{nbytes / t_gemv / 1e9:<6.0f}  {row['blocks']}{fused}",
        flush=True,
    )
    if do_sweep and m == 1:
        results = sweep(x, ws, bs)
        row["sweep_best"] = results[:5]
        top = ", ".join(f"({r['block_n']},{r['block_k']},{r['warps']}) {r['us']:.1f}" for r in results[:4])
        print(f"    best: {top}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    print(f"{'shape':<28}{'M':>3}{'MB':>8}{'cuBLAS us':>11}{'gemv us':>9}{'GB/s c/g':>14}  blocks")
    for model, layer, n, k, bias in shapes():
        copies = max(1, math.ceil(L2_BYTES / (n * k * 2)))
        ws = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        bs = [torch.randn(n, device=DEVICE, dtype=torch.bfloat16) for _ in range(copies)] if bias else None
        for m in (1, 2, 4):
            rows.append(bench_one(model, layer, m, ws, bs, args.sweep))
        del ws, bs
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
