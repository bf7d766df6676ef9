"""Fused CUDA versions of the layers' small ops, one Triton launch each.

`turbospark.engine.layers` calls these for CUDA tensors and keeps its plain torch code for
every other device, so the model code is the same everywhere. On a decode step of a small model
each op is a few microseconds of launch and tail; fusing residual add + RMSNorm, the rotary
embedding's three elementwise kernels, and SiLU * up removes five launches per layer.
"""

from __future__ import annotations

from typing import Any

import torch


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
