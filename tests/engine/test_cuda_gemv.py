"""The small-batch matmul kernels and the batched GPU sampler (`turbospark.engine.cuda_ops`).

Runs on a CUDA device (marker `gpu`). The matmuls accumulate in float32 and round once, as a
library matmul does: against a float32 reference they may differ by one bf16 rounding of the
output (relative 2**-8), so the bound is 2**-7 of the output's largest magnitude. The fused
kernels round where the unfused ops round, so they are held to the unfused CUDA path with the
same bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from turbospark.engine import cuda_ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = torch.device("cuda")


def randn(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, torch.bfloat16)


def assert_close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.float().abs().max().item()
    err = (got.float() - want.float()).abs().max().item()
    assert err <= scale * 2**-7, f"max abs error {err} for outputs up to {scale}"


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (97, 200), (1152, 896), (896, 4864), (18, 2500)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_equals_a_float32_matmul(m: int, n: int, k: int, bias: bool) -> None:
    x, w = randn(m, k, seed=1), randn(n, k, seed=2)
    b = randn(n, seed=3) if bias else None
    want = F.linear(x.float(), w.float(), b.float() if b is not None else None)
    assert_close_bf16(cuda_ops.gemv(x, w, b), want)


def test_a_gemv_row_does_not_depend_on_the_other_rows() -> None:
    # rows 0..2 of a batch of 4 and a batch of 3 (same BLOCK_M): bit for bit
    x, w = randn(4, 896, seed=4), randn(1152, 896, seed=5)
    assert torch.equal(cuda_ops.gemv(x, w, None)[:3], cuda_ops.gemv(x[:3], w, None))


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_silu_equals_the_unfused_ops(m: int, bias: bool) -> None:
    inter, k = 4864, 896
    x, w = randn(m, k, seed=6), randn(2 * inter, k, seed=7) * 0.05
    b = randn(2 * inter, seed=8) if bias else None
    want = cuda_ops.silu_mul(F.linear(x, w, b), inter)
    assert_close_bf16(cuda_ops.gate_up_silu(x, w, b)[0], want)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (32, 8, 128), (4, 1, 16)])
def test_qkv_rotary_equals_the_projection_then_rotary(
    m: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    k = 512
    total = heads + 2 * kv_heads
    x, w, b = (
        randn(m, k, seed=9),
        randn(total * head_dim, k, seed=10) * 0.05,
        randn(total * head_dim, seed=11),
    )
    angles = torch.rand(m, 1, head_dim // 2, generator=torch.Generator().manual_seed(12)) * 6.28
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(DEVICE, torch.bfloat16)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(DEVICE, torch.bfloat16)
    qkv = F.linear(x, w, b).view(m, total, head_dim)
    rotated = cuda_ops.rotary(qkv[:, : heads + kv_heads], cos, sin)
    want = torch.cat([rotated, qkv[:, heads + kv_heads :]], dim=1)
    got, _ = cuda_ops.qkv_rotary(x, w, b, cos, sin, heads + kv_heads, head_dim)
    assert got.shape == (m, total, head_dim)
    assert_close_bf16(got, want)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("first_layer", [False, True])
def test_norms_inside_the_matmuls_equal_the_norm_kernel_then_the_matmul(m: int, first_layer: bool) -> None:
    hidden, inter, heads, kv_heads, head_dim = 896, 4864, 14, 2, 64
    x, res = randn(m, hidden, seed=13), randn(m, hidden, seed=14)
    norm_w = randn(hidden, seed=15).abs() + 0.5
    residual = None if first_layer else res
    normed, summed = cuda_ops.rms_norm(x, norm_w, 1e-6, residual)
    norm = cuda_ops.Norm(norm_w, 1e-6, residual)

    w = randn(2 * inter, hidden, seed=16) * 0.05
    assert cuda_ops.fuses_norm(hidden, w)
    got, got_summed = cuda_ops.gate_up_silu(x, w, None, norm)
    assert_close_bf16(got, cuda_ops.gate_up_silu(normed, w, None)[0])
    qkv_w = randn((heads + 2 * kv_heads) * head_dim, hidden, seed=17) * 0.05
    bias = randn(qkv_w.shape[0], seed=18)
    cos = torch.ones(m, 1, head_dim, device=DEVICE, dtype=torch.bfloat16)
    sin = torch.zeros(m, 1, head_dim, device=DEVICE, dtype=torch.bfloat16)
    qkv, qkv_summed = cuda_ops.qkv_rotary(x, qkv_w, bias, cos, sin, heads + kv_heads, head_dim, norm)
    assert_close_bf16(qkv, cuda_ops.qkv_rotary(normed, qkv_w, bias, cos, sin, heads + kv_heads, head_dim)[0])
    if first_layer:
        assert got_summed is None and qkv_summed is None
    else:  # the residual sum is the norm kernel's, bit for bit
        assert summed is not None and got_summed is not None and qkv_summed is not None
        assert torch.equal(got_summed, summed) and torch.equal(qkv_summed, summed)


def test_qkv_rotary_writes_the_cache_as_the_attention_store_does() -> None:
    from turbospark.engine.attention import build_attention_metadata
    from turbospark.engine.cuda_attention import CudaAttention

    m, k, heads, kv_heads, head_dim, slots = 3, 256, 4, 2, 32, 64
    x, w = randn(m, k, seed=19), randn((heads + 2 * kv_heads) * head_dim, k, seed=20) * 0.05
    angles = torch.rand(m, 1, head_dim // 2, generator=torch.Generator().manual_seed(21))
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(DEVICE, torch.bfloat16)
    sin = torch.cat([-angles.sin(), angles.sin()], -1).to(DEVICE, torch.bfloat16)
    meta, _ = build_attention_metadata([[1], [3], [2]], [4, 0, 9], [1, 1, 1], 16, DEVICE)
    meta.slot_mapping[1] = -1  # a padding row writes nowhere
    k_cache, v_cache = randn(kv_heads, slots, head_dim, seed=22), randn(kv_heads, slots, head_dim, seed=23)
    k_want, v_want, k_got, v_got = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    qkv, _ = cuda_ops.qkv_rotary(x, w, None, cos, sin, heads + kv_heads, head_dim)
    CudaAttention().store_kv(
        qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :], k_want, v_want, meta
    )
    store = (k_got, v_got, meta.slot_mapping, heads)
    qkv2, _ = cuda_ops.qkv_rotary(x, w, None, cos, sin, heads + kv_heads, head_dim, None, store)
    assert torch.equal(qkv2, qkv)
    assert torch.equal(k_got, k_want) and torch.equal(v_got, v_want)


def test_sampled_rows_follow_the_distribution_and_their_seeds() -> None:
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125])
    rows = 4000
    logits = torch.full((rows, 50_000), float("-inf"))
    logits[:, :4] = probs.log()
    logits = logits.to(DEVICE)
    seeds = (torch.arange(rows, dtype=torch.int64) * 7919 + 13).to(DEVICE)
    ones = torch.ones(rows, device=DEVICE)
    tokens = cuda_ops.sample_rows(logits, ones, seeds)
    assert int(tokens.max()) < 4  # masked (-inf) tokens are never drawn
    freq = torch.bincount(tokens.long().cpu(), minlength=4).float() / rows
    assert (freq - probs).abs().max().item() < 0.03  # 4000 draws: a few standard deviations
    assert torch.equal(cuda_ops.sample_rows(logits, ones, seeds), tokens)  # same seeds, same draws
    cold = cuda_ops.sample_rows(logits, torch.full((rows,), 100.0, device=DEVICE), seeds)
    assert int(cold.max()) == 0  # temperature 0.01: the argmax
