"""The CUDA attention backend (Triton kernels) agrees with the plain reference on the paged cache.

Runs on a CUDA device (marker `gpu`). Tolerance: bf16 inputs, float32 accumulation in both; the
outputs are averages of O(1) values, so atol 2e-2 is a few bf16 ulps.
"""

from __future__ import annotations

import random

import pytest
import torch

from turbospark.engine.attention import build_attention_metadata, reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = [
    [(0, 9)],  # a prompt from scratch
    [(5, 1)],  # one decode
    [(7, 1), (0, 1), (12, 1), (3, 1)],  # a decode batch of mixed lengths
    [(6, 5), (9, 1), (0, 7), (2, 1)],  # chunks after a prefix, decodes, a fresh prompt
    [(0, 300), (40, 1)],  # a long prompt spanning many query blocks, beside a decode
    [(700, 1)],  # a long decode: context split across programs
    [(c, 1) for c in range(0, 600, 37)],  # 17 decodes of spread lengths
    [(130, 70), (0, 1), (33, 200)],  # long chunks after prefixes
]


def run_case(shape, scattered, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed):
    from turbospark.engine.cuda_attention import CudaAttention

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [(c + n + block_size - 1) // block_size for c, n in shape]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(num_blocks))
    if scattered:
        rng.shuffle(free)
    tables = [[free.pop(0) for _ in range(n)] for n in blocks_needed]
    cached = [c for c, _ in shape]
    new = [n for _, n in shape]
    num_tokens = sum(new)
    slots = num_blocks * block_size

    def randn(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    k_cache, v_cache = randn(num_kv_heads, slots, head_dim), randn(num_kv_heads, slots, head_dim)
    # q, k, v as the model hands them over: strided views of one fused projection
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    q, k, v = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    meta, _ = build_attention_metadata(tables, cached, new, block_size, torch.device(device))
    kc, vc = k_cache.clone(), v_cache.clone()
    want = reference_attention(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta, head_dim**-0.5)
    meta2, _ = build_attention_metadata(tables, cached, new, block_size, torch.device(device))
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    got = CudaAttention().forward(q, k, v, kc2, vc2, meta2, head_dim**-0.5)
    ref_kc, ref_vc = k_cache.clone(), v_cache.clone()
    from turbospark.engine.attention import write_kv

    write_kv(k, v, ref_kc, ref_vc, meta)
    assert torch.equal(kc2, ref_kc) and torch.equal(vc2, ref_vc)  # the same slots written
    return got.float(), want


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(14, 2, 64, 16), (32, 8, 128, 16), (4, 4, 32, 4), (12, 2, 128, 32)],  # Qwen2.5-0.5B, Llama-3-8B
)
def test_cuda_attention_equals_the_reference(shape, scattered, num_heads, num_kv_heads, head_dim, block_size):
    got, want = run_case(
        shape,
        scattered,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        torch.bfloat16,
        "cuda",
        seed=len(shape),
    )
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
