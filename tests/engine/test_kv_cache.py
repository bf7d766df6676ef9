"""Block allocator invariants and the paged cache's bookkeeping."""

from __future__ import annotations

import random

import pytest
import torch

from turbospark.engine.kv_cache import BlockAllocator, KVCache


def test_allocate_and_free_keep_the_free_set_exact() -> None:
    alloc = BlockAllocator(8)
    assert alloc.can_allocate(8) and not alloc.can_allocate(9)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert a == [0, 1, 2] and b == [3, 4, 5, 6, 7]  # lowest ids first: contiguous for a lone sequence
    assert alloc.num_free_blocks == 0 and not alloc.can_allocate(1) and alloc.can_allocate(0)
    alloc.free(a)
    alloc.check()
    assert alloc.num_free_blocks == 3
    assert alloc.allocate(2) == [0, 1]
    alloc.check()


def test_misuse_trips_the_assertions() -> None:
    alloc = BlockAllocator(4)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    with pytest.raises(AssertionError, match="freed twice"):
        alloc.free(blocks[:1])
    with pytest.raises(AssertionError, match="out of range"):
        alloc.free([4])
    with pytest.raises(AssertionError, match="asked for 5"):
        alloc.allocate(5)
    alloc.check()


def test_random_workload_never_double_allocates() -> None:
    rng = random.Random(0)
    alloc = BlockAllocator(64)
    owned: list[list[int]] = []
    for _ in range(2000):
        if owned and (rng.random() < 0.45 or not alloc.can_allocate(1)):
            alloc.free(owned.pop(rng.randrange(len(owned))))
        else:
            n = rng.randint(0, 6)
            if alloc.can_allocate(n):
                owned.append(alloc.allocate(n))
        held = [b for blocks in owned for b in blocks]
        assert len(held) == len(set(held))
        assert len(held) + alloc.num_free_blocks == 64
    alloc.check()


def test_kv_cache_grows_block_tables_and_releases_them() -> None:
    cache = KVCache(
        num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32
    )
    assert cache.k.shape == (2, 2, 64, 8) and cache.num_slots == 64
    table: list[int] = []
    assert cache.grow(table, 1) and table == [0]
    assert cache.grow(table, 16) and table == [0]
    assert cache.grow(table, 17) and table == [0, 1]
    other: list[int] = []
    assert cache.grow(other, 32) and other == [2, 3]
    assert not cache.grow(table, 33)  # full: nothing taken
    assert table == [0, 1] and cache.allocator.num_free_blocks == 0
    cache.release(table)
    assert table == [] and cache.allocator.num_free_blocks == 2
    cache.allocator.check()
