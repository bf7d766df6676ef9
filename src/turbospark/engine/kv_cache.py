"""The paged KV cache: one preallocated slab per layer, handed out in fixed-size blocks.

A slot is one token's keys/values for every kv head of one layer; a block is `block_size`
consecutive slots. Each sequence owns a block table (its block ids in order), so sequence
positions map to slots as `table[pos // block_size] * block_size + pos % block_size`.
`BlockAllocator` owns which blocks are free and asserts its invariants on every change; the
slab itself is allocated with `torch.empty`, so untouched blocks cost no resident memory.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

import torch

from turbospark.engine.attention import AttentionBackend, AttentionMetadata, CpuAttention


class BlockAllocator:
    """Free-list of block ids. Lowest ids go first, so a lone sequence gets contiguous blocks
    (attention then reads a view of the cache instead of gathering)."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # a heap
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), f"asked for {num_blocks} blocks, {len(self._free)} free"
        block_ids = [heapq.heappop(self._free) for _ in range(num_blocks)]
        for b in block_ids:
            assert self._is_free[b], f"block {b} handed out twice"
            self._is_free[b] = False
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            assert 0 <= b < self.num_blocks, f"block {b} out of range"
            assert not self._is_free[b], f"block {b} freed twice"
            self._is_free[b] = True
            heapq.heappush(self._free, b)
        assert len(self._free) <= self.num_blocks

    def check(self) -> None:
        """Full consistency check (tests): the heap and the flags describe the same free set."""
        assert len(set(self._free)) == len(self._free)
        assert sorted(self._free) == [b for b, f in enumerate(self._is_free) if f]


class LayerCache:
    """One layer's share of the cache, handed to that layer's attention."""

    __slots__ = ("backend", "k", "v")

    def __init__(self, k: torch.Tensor, v: torch.Tensor, backend: AttentionBackend) -> None:
        self.k = k
        self.v = v
        self.backend = backend

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Stores the step's k/v and attends; q (num_tokens, num_heads, head_dim) -> (num_tokens,
        num_heads * head_dim)."""
        return self.backend.forward(q, k, v, self.k, self.v, meta, scale)


class KVCache:
    """Keys and values for every layer: two tensors (num_layers, num_kv_heads, num_slots, head_dim).

    Head-major, so one sequence's keys for a head are a (kv_len, head_dim) run of memory: the
    layout both SDPA and the decode matmuls read without a copy. `attention` is the backend that
    reads and writes this layout (`CpuAttention` unless given).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        attention: AttentionBackend | None = None,
    ) -> None:
        self.attention: AttentionBackend = attention or CpuAttention()
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # empty, not zeros: pages are only touched (and resident) once tokens are written
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self.k[index], self.v[index], self.attention)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extends `block_table` in place to hold `num_tokens`; False (nothing taken) if full."""
        needed = self.num_blocks_for(num_tokens) - len(block_table)
        if needed <= 0:
            return True
        if not self.allocator.can_allocate(needed):
            return False
        block_table.extend(self.allocator.allocate(needed))
        return True

    def release(self, block_table: list[int]) -> None:
        self.allocator.free(block_table)
        block_table.clear()
