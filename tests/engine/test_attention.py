"""Every attention backend agrees with the plain per-sequence reference on the paged cache."""

from __future__ import annotations

import random

import pytest
import torch

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
    ],
)
def test_cpu_attention_equals_the_reference(shape, scattered) -> None:
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
