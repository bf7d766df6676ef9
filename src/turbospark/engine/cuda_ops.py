"""Fused CUDA versions of the layers' small ops, one Triton launch each.

A CUDA model's layers reach these through its ops (`turbospark.engine.ops.CudaOps`, picked
when the model is built); other devices' ops keep other kernels, so the model code is the same
everywhere. On a decode step of a small model each op is a few microseconds of launch and tail;
fusing residual add + RMSNorm, the rotary embedding's three elementwise kernels, and SiLU * up
removes five launches per layer.

Small batches (at most `GEMV_MAX_ROWS` rows, the decode steps of 1..4 sequences) also take
matmul kernels of our own (`gemv`, `gate_up_silu`, `qkv_rotary`): at M = 1 a library matmul of a
small model's layer is launch- and tail-bound (on Qwen2.5-0.5B cuBLAS reads its 30 MB of weights
per layer at about a third of the copy bandwidth), and two of them fuse the op after the matmul
(SiLU * up; bias and rotary on q and k), two launches fewer per layer. Larger batches keep cuBLAS.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

GEMV_MAX_ROWS = 4
"""Rows (tokens) at most for the small-batch matmul kernels; larger batches use cuBLAS."""
GEMV_MAX_WEIGHT_BYTES = {1: 32 << 20, 2: 9_500_000, 4: 4_500_000}
"""By pow2(rows): the largest weight (bytes) the small-batch kernels take; larger ones go to
cuBLAS. Measured on an H200 (RESULTS.md): at one row the kernels beat cuBLAS on a small model's
layers (2-17 MB: launch- and tail-bound there) and only match it on large ones, where the fused
variants lose (each program re-reads the input row); at 2 and 4 rows cuBLAS wins from about
10 MB and 5 MB."""
small_batch_kernels = True
"""Off: every matmul goes to cuBLAS (for A/B measurements; read when a graph is captured)."""
fuse_norms = True
"""Off: the RMSNorms stay their own kernels on the small-batch path (A/B measurements)."""


def _kernels() -> Any:
    from turbospark.engine import triton_kernels

    return triton_kernels


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def supports_rows(x: torch.Tensor) -> bool:
    """True for a 2-D tensor of unit-stride rows (what the row kernels take)."""
    return x.dim() == 2 and x.stride(-1) == 1


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rms_norm(x [+ residual]) * weight, x + residual or None); x, residual (rows, hidden)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    if rows:
        res = residual if residual is not None else x
        _kernels().rms_norm_kernel[(rows,)](
            x,
            res,
            weight,
            out,
            res_out if res_out is not None else out,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            res_out.stride(0) if res_out is not None else 0,
            eps,
            N=n,
            BLOCK_N=_pow2(n),
            HAS_RESIDUAL=residual is not None,
            num_warps=4 if n <= 2048 else 8,
        )
    return out, res_out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (num_tokens, heads, head_dim), cos/sin (num_tokens, 1, head_dim) -> rotated, contiguous."""
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if tokens:
        assert cos.stride() == sin.stride() and cos.stride(-1) == 1
        _kernels().rotary_kernel[(tokens, heads)](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            out.stride(0),
            out.stride(1),
            HALF=dim // 2,
            num_warps=1,
        )
    return out


def supports_rotary(x: torch.Tensor) -> bool:
    half = x.shape[-1] // 2
    return x.dim() == 3 and x.stride(-1) == 1 and x.shape[-1] % 2 == 0 and half == _pow2(half)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """gate_up (rows, 2 * inter) -> silu(gate) * up (rows, inter)."""
    rows = gate_up.shape[0]
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _kernels().silu_mul_kernel[(rows, triton_cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK=block, num_warps=4
        )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


# ---- small-batch matmuls ----


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's interpreter (tests on CPU): a small pretend GPU
        return 8
    index = device.index if device.index is not None else torch.cuda.current_device()
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def gemv_blocks(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for reducing n weight rows of length k.

    A function of (n, k) alone, never of the number of rows M, so a row's result is the same in
    a padded graph replay and an eager step. From a sweep on an H200 (benchmarks/
    bench_gpu_matmul.py --sweep, RESULTS.md): the fastest tiles are small (4-16 KB) and many:
    the whole row in one tile up to 4096 columns, 2048 beyond 8192; 4096 elements per tile for
    short rows, 8192 for long ones; BLOCK_N halved until there are two programs per SM and
    doubled while there are more than 32k programs (an lm_head).
    """
    block_k = min(_pow2(k), 4096 if k <= 8192 else 2048)
    block_n = max(1, (4096 if k < 2048 else 8192) // block_k)
    while block_n > 1 and triton_cdiv(n, block_n) < 2 * _num_sms(device):
        block_n //= 2
    while triton_cdiv(n, block_n) > 32768 and block_n * block_k < 16384:
        block_n *= 2
    return block_n, block_k, 4


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `x @ weight.T` should take the small-batch kernel: a CUDA batch of at most
    `GEMV_MAX_ROWS` unit-stride rows against a contiguous half-precision weight of at most
    `GEMV_MAX_WEIGHT_BYTES[pow2(rows)]` bytes. The choice depends on pow2(rows), as the block
    sizes do, so a padded graph replay and an eager step of the same rows choose alike."""
    rows = x.shape[0] if x.dim() == 2 else 0
    return (
        small_batch_kernels
        and x.is_cuda
        and 0 < rows <= GEMV_MAX_ROWS
        and x.stride(-1) == 1
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and weight.is_contiguous()
        and weight.numel() * weight.element_size() <= GEMV_MAX_WEIGHT_BYTES[_pow2(rows)]
    )


def fuses_norm(hidden: int, weight: torch.Tensor) -> bool:
    """True when the norm before `weight` can run inside its kernel: the row is one tile."""
    return fuse_norms and gemv_blocks(weight.shape[0], hidden, weight.device)[1] >= hidden


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ weight (N, K).T [+ bias] for small M; see `use_gemv`."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_n, block_k, warps = gemv_blocks(n, k, x.device)
    _kernels().gemv_kernel[(triton_cdiv(n, block_n),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=_pow2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out


class Norm:
    """An RMSNorm to run inside the matmul after it: the kernel's x is the norm's input, and
    `residual` (None: none, the first layer) is added to it first, as `rms_norm` does."""

    __slots__ = ("eps", "residual", "weight")

    def __init__(self, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> None:
        self.weight = weight
        self.eps = eps
        self.residual = residual


def _norm_args(x: torch.Tensor, norm: Norm | None) -> tuple[list[Any], torch.Tensor | None]:
    """(kernel arguments x_ptr .. stride_rom, the summed residual the kernel writes or None)."""
    if norm is None or norm.residual is None:
        args = [x, x, x, norm.weight if norm else x, norm.eps if norm else 0.0, x.stride(0), 0, 0]
        return args, None
    res = norm.residual
    assert res.shape == x.shape and res.stride(-1) == 1
    summed = torch.empty_like(x)
    args = [x, res, summed, norm.weight, norm.eps, x.stride(0), res.stride(0), summed.stride(0)]
    return args, summed


def gate_up_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm: Norm | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """silu(x @ gate.T) * (x @ up.T) for weight = cat(gate, up) (2 * inter, K); small M.

    With `norm`, x is first replaced by norm(x + residual) inside the kernel (see `Norm`;
    needs `fuses_norm`); returns (the product, x + residual or None)."""
    m, k = x.shape
    inter = weight.shape[0] // 2
    out = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    # two rows per output column: blocks sized as for a matrix of 2 * inter rows
    block_n, block_k, warps = gemv_blocks(2 * inter, k, x.device)
    block_n = max(1, block_n // 2)
    args, summed = _norm_args(x, norm)
    x_ptr, res, res_out, norm_w, eps, stride_xm, stride_rm, stride_rom = args
    _kernels().gate_up_silu_kernel[(triton_cdiv(inter, block_n),)](
        x_ptr,
        res,
        res_out,
        norm_w,
        eps,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        inter,
        k,
        stride_xm,
        stride_rm,
        stride_rom,
        weight.stride(0),
        out.stride(0),
        NORM=norm is not None,
        HAS_RESIDUAL=summed is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=_pow2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out, summed


def stores_kv(backend: object) -> bool:
    """True when `qkv_rotary` can write k and v into the cache of this attention backend."""
    from turbospark.engine.cuda_attention import CudaAttention

    return isinstance(backend, CudaAttention)


def supports_qkv_rotary(head_dim: int) -> bool:
    half = head_dim // 2
    return head_dim % 2 == 0 and half == _pow2(half)


def qkv_rotary(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated_heads: int,
    head_dim: int,
    norm: Norm | None = None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x (M, K) @ weight (heads * head_dim, K).T [+ bias] -> (M, heads, head_dim), the first
    `rotated_heads` heads rotated by cos/sin (M, 1, head_dim) as `rotary` does; small M.

    With `norm`, x is first replaced by norm(x + residual) inside the kernel (see `Norm`;
    needs `fuses_norm`); returns (q/k/v, x + residual or None). With `store` = (k_cache,
    v_cache, slot_mapping, num_heads), the k and v heads also go to the cache as
    `CudaAttention.store_kv` writes them (then attend with `CudaAttention.attend`)."""
    m, k = x.shape
    heads = weight.shape[0] // head_dim
    out = torch.empty(m, heads, head_dim, dtype=x.dtype, device=x.device)
    assert cos.stride() == sin.stride() and cos.stride(-1) == 1
    half = head_dim // 2
    block_n, block_k, warps = gemv_blocks(weight.shape[0], k, x.device)
    block_p = max(1, min(half, block_n // 2))
    args, summed = _norm_args(x, norm)
    x_ptr, res, res_out, norm_w, eps, stride_xm, stride_rm, stride_rom = args
    if store is not None:
        k_cache, v_cache, slots, num_heads = store
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    else:
        k_cache, v_cache, slots, num_heads = out, out, out, rotated_heads
    _kernels().qkv_rotary_kernel[(heads, triton_cdiv(half, block_p))](
        x_ptr,
        res,
        res_out,
        norm_w,
        eps,
        weight,
        bias if bias is not None else weight,
        cos,
        sin,
        out,
        k_cache,
        v_cache,
        slots,
        m,
        k,
        stride_xm,
        stride_rm,
        stride_rom,
        weight.stride(0),
        cos.stride(0),
        out.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        NUM_HEADS=num_heads,
        ROTATED_HEADS=rotated_heads,
        HEAD_DIM=head_dim,
        STORE_KV=store is not None,
        NORM=norm is not None,
        HAS_RESIDUAL=summed is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=_pow2(m),
        BLOCK_P=block_p,
        BLOCK_K=block_k,
        num_warps=warps,
    )
    return out, summed


# ---- sampling ----


def sample_rows(logits: torch.Tensor, inv_temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """One token per row of logits (rows, vocab) drawn from softmax(logits * inv_temperature[row])
    with row r's noise keyed by seeds[r] alone (int64, below 2**31): one launch for the batch."""
    rows, vocab = logits.shape
    assert logits.stride(-1) == 1
    out = torch.empty(rows, dtype=torch.int32, device=logits.device)
    if rows:
        _kernels().gumbel_argmax_kernel[(rows,)](
            logits, inv_temperature, seeds, out, vocab, logits.stride(0), BLOCK=2048, num_warps=8
        )
    return out


TRUNCATED_MAX_WIDTH = 4096
"""The widest candidate list (largest top-k) `sample_truncated` takes; rows with more go to
`sampling.truncate_rows` and `sample_rows`."""


def sample_truncated(values: torch.Tensor, ids: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """One token per row from its candidates: values (rows, width) float32, the largest raw
    logits of the row sorted descending, and ids their token ids (`torch.topk`'s pair); params
    (rows, 5) float64: temperature, top-k (<= width), min-p, top-p (>= 1: off) and seed (an
    integer below 2**31) per row. Filters in `sampling.truncate_rows`' order and draws as
    `sample_rows` does over the result (same noise for the same seed and candidate position);
    `values` is left holding the filtered values (-inf where cut). One launch for the batch;
    returns the token ids (rows,) int64."""
    rows, width = values.shape
    assert values.dtype == torch.float32 and values.stride(-1) == 1 and ids.stride(-1) == 1
    assert params.dtype == torch.float64 and params.is_contiguous() and params.shape == (rows, 5)
    assert width <= TRUNCATED_MAX_WIDTH
    out = torch.empty(rows, dtype=torch.int64, device=values.device)
    if rows:
        block = max(_pow2(width), 16)
        _kernels().truncated_sample_kernel[(rows,)](
            values,
            ids,
            params,
            out,
            width,
            values.stride(0),
            ids.stride(0),
            BLOCK=block,
            num_warps=1 if block <= 256 else 4,
        )
    return out
