"""Block manager invariants, the prefix cache, and the paged cache's storage."""

from __future__ import annotations

import random

import pytest
import torch

from turbospark.engine.kv_cache import BlockManager, KVCache


def test_allocate_and_release_keep_the_free_set_exact() -> None:
    blocks = BlockManager(8, block_size=4)
    assert blocks.can_allocate(8) and not blocks.can_allocate(9)
    a = blocks.allocate(3)
    b = blocks.allocate(5)
    assert a == [0, 1, 2] and b == [3, 4, 5, 6, 7]  # lowest ids first: contiguous for a lone sequence
    assert blocks.num_free_blocks == 0 and not blocks.can_allocate(1) and blocks.can_allocate(0)
    blocks.release(a)
    blocks.check()
    assert blocks.num_free_blocks == 3 and a == []
    assert blocks.allocate(2) == [0, 1]
    blocks.check()


def test_misuse_trips_the_assertions() -> None:
    blocks = BlockManager(4, block_size=4)
    table = blocks.allocate(2)
    held = list(table)
    blocks.release(table)
    with pytest.raises(AssertionError, match="released twice"):
        blocks.release(held[:1])
    with pytest.raises(AssertionError, match="asked for 5"):
        blocks.allocate(5)
    blocks.check()


def test_grow_extends_a_table_or_takes_nothing() -> None:
    blocks = BlockManager(4, block_size=16)
    table: list[int] = []
    assert blocks.grow(table, 1) and table == [0]
    assert blocks.grow(table, 16) and table == [0]
    assert blocks.grow(table, 17) and table == [0, 1]
    other: list[int] = []
    assert blocks.grow(other, 32) and other == [2, 3]
    assert not blocks.grow(table, 33)  # full: nothing taken
    assert table == [0, 1] and blocks.num_free_blocks == 0
    blocks.release(table)
    assert table == [] and blocks.num_free_blocks == 2
    blocks.check()


def fill(blocks: BlockManager, tokens: list[int]) -> list[int]:
    """A sequence that computed `tokens` from scratch: its table, with full blocks registered."""
    table: list[int] = []
    assert blocks.grow(table, len(tokens))
    blocks.register_full_blocks(tokens, table, len(tokens), 0, None)
    return table


def test_a_shared_prefix_is_found_block_by_block() -> None:
    blocks = BlockManager(16, block_size=4)
    first = list(range(100, 111))  # 11 tokens: two full blocks and a partial one
    table = fill(blocks, first)
    hits, _ = blocks.match_prefix([*first[:8], 7, 7, 7])
    assert hits == table[:2]
    hits, _ = blocks.match_prefix([*first[:5], 9, 9, 9, 9])
    assert hits == table[:1]  # the second block differs
    hits, _ = blocks.match_prefix(first[:8])
    assert hits == table[:1]  # the last token is always computed, so its block is not taken
    assert blocks.match_prefix([1, *first])[0] == []  # same tokens at other positions: no hit
    blocks.check()


def test_released_blocks_stay_cached_until_their_slot_is_needed() -> None:
    blocks = BlockManager(4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8]
    table = fill(blocks, tokens)
    blocks.release(table)
    assert blocks.num_free_blocks == 4 and blocks.num_cached_blocks == 4
    hits, _ = blocks.match_prefix([*tokens, 9])
    assert len(hits) == 4
    blocks.share(hits[:2])  # a new sequence takes the first two
    assert blocks.num_free_blocks == 2
    fresh = blocks.allocate(1)  # evicts the least recently released: the prefix's tail
    assert fresh == [hits[3]]
    assert blocks.match_prefix([*tokens, 9])[0] == hits[:3]
    blocks.check()


def test_random_workload_keeps_every_invariant() -> None:
    rng = random.Random(0)
    blocks = BlockManager(48, block_size=4)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(4, 24))] for _ in range(5)]
    owned: list[list[int]] = []
    for _ in range(2000):
        if owned and (rng.random() < 0.45 or blocks.num_free_blocks < 8):
            blocks.release(owned.pop(rng.randrange(len(owned))))
        else:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 8))]
            hits, key = blocks.match_prefix(tokens)
            unreferenced = sum(1 for b in hits if blocks.ref_counts[b] == 0)
            needed = blocks.num_blocks_for(len(tokens)) - len(hits)
            if needed <= blocks.num_free_blocks - unreferenced:
                blocks.share(hits)
                table = hits + blocks.allocate(needed)
                blocks.register_full_blocks(tokens, table, len(tokens), len(hits), key)
                owned.append(table)
        held: dict[int, int] = {}
        for table in owned:
            for b in table:
                held[b] = held.get(b, 0) + 1
        assert all(blocks.ref_counts[b] == held.get(b, 0) for b in range(48))
        blocks.check()
    for table in owned:
        blocks.release(table)
    assert blocks.num_used_blocks == 0
    blocks.check()


def test_kv_cache_storage_shape() -> None:
    cache = KVCache(
        num_layers=2, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32
    )
    assert cache.k.shape == (2, 2, 64, 8) and cache.num_slots == 64
    layer = cache.layer(1)
    assert layer.k.data_ptr() == cache.k[1].data_ptr()
