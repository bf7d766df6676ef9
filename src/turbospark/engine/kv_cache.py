"""The paged KV cache: one preallocated slab per layer, handed out in fixed-size blocks.

A slot is one token's keys/values for every kv head of one layer; a block is `block_size`
consecutive slots. Each sequence owns a block table (its block ids in order), so sequence
positions map to slots as `table[pos // block_size] * block_size + pos % block_size`.
`KVCache` is the storage (allocated with `torch.empty`, so untouched blocks cost no resident
memory) and the attention backend that reads it; `BlockManager` owns which block holds what
(reference counts, the prefix cache, eviction) and asserts its invariants.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict
from typing import Protocol

import torch

from turbospark.engine.attention import AttentionBackend, AttentionMetadata, CpuAttention


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

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def layer(self, index: int) -> LayerCache:
        return LayerCache(self.k[index], self.v[index], self.attention)


class BlockStore(Protocol):
    """Where full blocks outlive the cache (`engine/disk_cache.py`): by chain key."""

    def __contains__(self, key: int) -> bool: ...

    def save(self, key: int, block: int) -> None: ...

    def load(self, key: int, block: int) -> bool: ...


class BlockManager:
    """Which KV blocks hold what: reference counts, the prefix cache, LRU eviction.

    A full block that a sequence has computed is registered under its chain key: a hash of the
    previous block's key and the block's token ids, so a key names a whole prefix. The first
    block's "previous key" is the sequence's cache salt (`root_key`): sequences with different
    salts never share a block, so one tenant cannot time another's prompts through cache hits. A new
    sequence walks its prompt block by block and shares every block already registered (its
    reference count goes up; nothing is recomputed). A block nobody references keeps its
    contents and stays findable in an LRU line until its slot is needed: never-used blocks are
    handed out first, then the least recently released cached block is evicted.

    Keys are stable digests (the same prompt gets the same keys in every process), so a `store`
    (the disk prefix cache) can keep blocks past eviction and restarts: every block registered
    is saved there, and a prefix that runs out in memory goes on from it (`stored_continuation`,
    `load_stored`).

    Invariants (`check`): every block is exactly one of in use (ref > 0), free, or cached-and-
    evictable; a key maps to a block that carries that key; the counts add up.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # whether blocks holding generated tokens are registered too (off: only prompts', see
        # `scheduler._cacheable`)
        self.cache_generated = True
        self.ref_counts = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks))  # a heap: low ids first keep runs contiguous
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0, registered, LRU first
        self._key_of: dict[int, int] = {}  # block id -> chain key
        self._block_of: dict[int, int] = {}  # chain key -> block id
        self.num_hit_tokens = 0  # lifetime prefix-cache hits, for metrics
        self.store: BlockStore | None = None

    # ---- counts ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never used, or cached but unreferenced)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- plain allocation (no sharing) ----
    def can_allocate(self, num_blocks: int) -> bool:
        return 0 <= num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        assert self.can_allocate(num_blocks), f"asked for {num_blocks} blocks, {self.num_free_blocks} free"
        return [self._take() for _ in range(num_blocks)]

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        """Extends `block_table` in place to hold `num_tokens`; False (nothing taken) if full."""
        needed = self.num_blocks_for(num_tokens) - len(block_table)
        if needed <= 0:
            return True
        if not self.can_allocate(needed):
            return False
        block_table.extend(self.allocate(needed))
        return True

    def release(self, block_table: list[int]) -> None:
        """Drops one reference to each block; tail blocks first, so an LRU eviction takes a
        prefix's end before its start."""
        for b in reversed(block_table):
            assert self.ref_counts[b] > 0, f"block {b} released twice"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self._key_of:
                    self._evictable[b] = None
                else:
                    heapq.heappush(self._free, b)
        block_table.clear()

    def _take(self) -> int:
        if self._free:
            b = heapq.heappop(self._free)
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._key_of.pop(b)]
        assert self.ref_counts[b] == 0, f"block {b} handed out twice"
        self.ref_counts[b] = 1
        return b

    # ---- prefix cache ----
    @staticmethod
    def chain_key(parent: int | None, block_ids: tuple[int, ...]) -> int:
        """A 64-bit digest of the parent key and the block's ids: the same in every process
        (Python's `hash` of a string is not), so it can name a block on disk."""
        h = hashlib.blake2b(b"-" if parent is None else parent.to_bytes(8, "little"), digest_size=8)
        try:
            h.update(array("q", block_ids).tobytes())
        except OverflowError:  # an id past 64 bits (none is today): its text
            h.update(repr(block_ids).encode())
        return int.from_bytes(h.digest(), "little")

    @staticmethod
    def root_key(salt: str | None) -> int | None:
        """The chain key a sequence's first block hangs from: None unsalted, else the salt's."""
        if salt is None:
            return None
        return int.from_bytes(
            hashlib.blake2b(b"cache_salt:" + salt.encode(), digest_size=8).digest(), "little"
        )

    def match_prefix(self, token_ids: list[int], salt: str | None = None) -> tuple[list[int], int | None]:
        """Registered blocks covering the longest cached prefix of `token_ids` under `salt` (full
        blocks, leaving at least one token to compute), and the chain key of the last one (the
        salt's root key when there is none)."""
        key = self.root_key(salt)
        if not self.enable_prefix_caching:
            return [], key
        hits: list[int] = []
        bs = self.block_size
        # the last token is always computed: its logits start the generation
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            next_key = self.chain_key(key, tuple(token_ids[start : start + bs]))
            b = self._block_of.get(next_key)
            if b is None:
                break
            hits.append(b)
            key = next_key
        return hits, key

    def stored_continuation(self, token_ids: list[int], num_hits: int, key: int | None) -> list[int]:
        """The chain keys of the blocks after the first `num_hits` (whose last key is `key`) that
        the store holds, in order, as `match_prefix` would walk them."""
        if self.store is None or not self.enable_prefix_caching:
            return []
        keys: list[int] = []
        bs = self.block_size
        for start in range(num_hits * bs, len(token_ids) - 1 - bs + 1, bs):
            next_key = self.chain_key(key, tuple(token_ids[start : start + bs]))
            if next_key not in self.store:
                break
            keys.append(next_key)
            key = next_key
        return keys

    def load_stored(self, keys: list[int], blocks: list[int]) -> int:
        """Reads the stored blocks `keys` into the freshly allocated `blocks` (in order) and
        registers them; stops at the first that cannot be read. Returns how many were."""
        assert self.store is not None
        for i, (key, b) in enumerate(zip(keys, blocks, strict=True)):
            if key in self._block_of or not self.store.load(key, b):
                return i
            self._block_of[key] = b
            self._key_of[b] = key
        return len(keys)

    def share(self, block_ids: list[int]) -> None:
        """Takes a reference to cached blocks found by `match_prefix`."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1

    def register_full_blocks(
        self,
        token_ids: list[int],
        block_table: list[int],
        num_computed: int,
        num_hashed: int,
        key: int | None,
    ) -> tuple[int, int | None]:
        """Registers the blocks of a sequence that became full and computed; returns the new
        (num_hashed, last key). A block whose content is already cached elsewhere stays
        private (the first copy keeps the key)."""
        if not self.enable_prefix_caching:
            return num_hashed, key
        bs = self.block_size
        while (num_hashed + 1) * bs <= num_computed:
            start = num_hashed * bs
            key = self.chain_key(key, tuple(token_ids[start : start + bs]))
            b = block_table[num_hashed]
            if key not in self._block_of and b not in self._key_of:
                self._block_of[key] = b
                self._key_of[b] = key
                if self.store is not None:
                    self.store.save(key, b)
            num_hashed += 1
        return num_hashed, key

    def check(self) -> None:
        """Full consistency check (tests)."""
        free = set(self._free)
        evictable = set(self._evictable)
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & evictable, "a block is both free and cached"
        for b in range(self.num_blocks):
            in_use = self.ref_counts[b] > 0
            assert self.ref_counts[b] >= 0
            assert in_use + (b in free) + (b in evictable) == 1, (
                f"block {b} is in {in_use, b in free, b in evictable}"
            )
            if b in evictable:
                assert b in self._key_of
            if b in free:
                assert b not in self._key_of
        for key, b in self._block_of.items():
            assert self._key_of.get(b) == key, f"key of block {b} disagrees"
        assert len(self._block_of) == len(self._key_of)


class ManagedKVCache(KVCache):
    """A `KVCache` with its own plain block bookkeeping (no prefix sharing), for code that drives
    a model without the engine: GPU benchmarks and model-level tests."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.blocks = BlockManager(self.num_blocks, self.block_size, enable_prefix_caching=False)

    def grow(self, block_table: list[int], num_tokens: int) -> bool:
        return self.blocks.grow(block_table, num_tokens)

    def release(self, block_table: list[int]) -> None:
        self.blocks.release(block_table)
