"""Every attention backend agrees with the plain per-sequence reference on the paged cache."""

from __future__ import annotations

import random

import pytest
import torch

from turbospark.engine import attention
from turbospark.engine.attention import CpuAttention, build_attention_metadata, reference_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 16, 4, 64


def random_step(rng: random.Random, shape: list[tuple[int, int]], scattered: bool):
    """Block tables for sequences (num_cached, num_new), blocks scattered or consecutive."""
    free = list(range(NUM_BLOCKS))
    if scattered:
        rng.shuffle(free)
    tables = []
    for cached, new in shape:
        n = (cached + new + BLOCK_SIZE - 1) // BLOCK_SIZE
        tables.append([free.pop(0) for _ in range(n)])
    return tables


@pytest.mark.parametrize("scattered", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        [(0, 9)],  # a prompt from scratch
        [(5, 1)],  # one decode
        [(7, 1), (0, 1), (12, 1), (3, 1)],  # a decode batch of mixed lengths
        [(6, 5), (9, 1), (0, 7), (2, 1)],  # chunks after a prefix, decodes, a fresh prompt
        [(150, 40)],  # a long chunk after a long cached prefix
        [(37, 1), (90, 23)],  # a decode beside a chunk
    ],
)
@pytest.mark.parametrize("flash", [True, False], ids=["flash", "masked-fallback"])
def test_cpu_attention_equals_the_reference(shape, scattered, flash, monkeypatch) -> None:
    if not flash:  # the path taken where torch has no CPU flash kernel with log-sum-exp
        monkeypatch.setattr(attention, "_FLASH_CPU", None)
    rng = random.Random(len(shape) * 2 + scattered)
    torch.manual_seed(0)
    tables = random_step(rng, shape, scattered)
    cached = [c for c, _ in shape]
    new = [n for _, n in shape]
    num_tokens = sum(new)
    k_cache = torch.randn(NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM)
    v_cache = torch.randn(NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    meta, positions = build_attention_metadata(tables, cached, new, BLOCK_SIZE, torch.device("cpu"))
    assert positions.tolist() == [p for c, n in shape for p in range(c, c + n)]
    kc, vc = k_cache.clone(), v_cache.clone()
    want = reference_attention(q, k, v, kc, vc, meta, 0.25)
    meta2, _ = build_attention_metadata(tables, cached, new, BLOCK_SIZE, torch.device("cpu"))
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    got = CpuAttention().forward(q, k, v, kc2, vc2, meta2, 0.25)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)  # the same slots written
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_bf16_chunk_after_a_prefix_matches_the_float32_reference() -> None:
    """The prefix / chunk merge works in float32 whatever the cache dtype: bf16 inputs land
    within bf16's rounding of the float32 answer."""
    torch.manual_seed(3)
    cached, new = 170, 60
    tables = [list(range((cached + new + BLOCK_SIZE - 1) // BLOCK_SIZE))]
    k_cache = torch.randn(NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM)
    v_cache = torch.randn(NUM_KV_HEADS, NUM_BLOCKS * BLOCK_SIZE, HEAD_DIM)
    q, k, v = (
        torch.randn(new, NUM_HEADS, HEAD_DIM),
        torch.randn(new, NUM_KV_HEADS, HEAD_DIM),
        torch.randn(new, NUM_KV_HEADS, HEAD_DIM),
    )
    meta, _ = build_attention_metadata(tables, [cached], [new], BLOCK_SIZE, torch.device("cpu"))
    want = reference_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25)
    bf = torch.bfloat16
    meta2, _ = build_attention_metadata(tables, [cached], [new], BLOCK_SIZE, torch.device("cpu"))
    got = CpuAttention().forward(q.to(bf), k.to(bf), v.to(bf), k_cache.to(bf), v_cache.to(bf), meta2, 0.25)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)
