"""Decode steps replayed from CUDA graphs; every other step runs eagerly.

A decode step of a small model is a few hundred short kernels: launched one by one from Python
the GPU mostly waits for the host. `CudaGraphRunner` captures the model's whole forward once
per batch size (1, 2, 4, ..., 256 by default) over static input buffers and then replays it,
one launch per step.

Interface (what a runner or scheduler calls)::

    graphs = CudaGraphRunner(model, kv_cache, max_blocks_per_seq=cdiv(max_context, block_size))
    graphs.capture()                           # once, after weights and cache exist (seconds)
    logits = graphs(input_ids, positions, meta)  # any step; (num_seqs, vocab) float32

`__call__` takes exactly what `model(input_ids, positions, meta, kv_cache)` takes, minus the
cache, and returns the same logits. A step replays a graph when it is all decodes
(`input_ids.shape[0] == meta.seq_lens.shape[0]`), has at most the largest captured batch, and
its block table is at most `max_blocks_per_seq` wide; otherwise (prefill, mixed, too large) it
runs the model eagerly. A replayed batch of n sequences is padded to the next captured size:
padding rows write no cache slot (slot -1) and attend over nothing (length 0), so they cost a
little compute and change nothing. Deciding costs no device sync: only shapes are read.

The logits of a replay are a view of the graph's static output buffer: read (sample) them before
the next call. The cache must be `KVCache` with a backend whose kernels are capturable
(`CudaAttention`); every captured graph shares one memory pool.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from turbospark.engine.attention import AttentionMetadata
from turbospark.engine.kv_cache import KVCache
from turbospark.engine.models import Model

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CudaGraphRunner:
    def __init__(
        self,
        model: Model,
        kv_cache: KVCache,
        *,
        max_blocks_per_seq: int,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    ) -> None:
        assert batch_sizes and min(batch_sizes) >= 1
        self.model = model
        self.kv_cache = kv_cache
        self.batch_sizes = sorted(set(batch_sizes))
        self.max_batch = self.batch_sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        device = kv_cache.k.device
        assert device.type == "cuda", "CUDA graphs need the cache on a CUDA device"
        n = self.max_batch
        # static inputs: every graph reads its leading rows of these
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.last_token_indices = torch.arange(n, dtype=torch.long, device=device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def _meta(self, batch: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch],
            query_start_loc=self.query_start_loc[: batch + 1],
            seq_lens=self.seq_lens[:batch],
            block_tables=self.block_tables[:batch],
            last_token_indices=self.last_token_indices[:batch],
            block_size=self.kv_cache.block_size,
        )

    def _run_static(self, batch: int) -> torch.Tensor:
        return self.model(self.input_ids[:batch], self.positions[:batch], self._meta(batch), self.kv_cache)

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per batch size, largest first so the smaller ones reuse its memory.

        The static buffers hold padding (slot -1, length 0) during capture: nothing is written
        to the cache.
        """
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for batch in reversed(self.batch_sizes):
                self._run_static(batch)  # compiles kernels, creates library handles
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for batch in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[batch] = self._run_static(batch)
            self._graphs[batch] = graph
        torch.cuda.synchronize()

    def static_inputs(self, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Views of the graphs' own input buffers for a decode step of `num_seqs` sequences.

        A caller that writes a step's inputs into these in place (its block-table rows and
        lengths kept there between steps) and passes them back to `__call__` skips the copies.
        """
        assert 1 <= num_seqs <= self.max_batch
        return self.input_ids[:num_seqs], self.positions[:num_seqs], self._meta(num_seqs)

    def can_replay(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        num_seqs = meta.seq_lens.shape[0]
        return (
            bool(self._graphs)
            and input_ids.shape[0] == num_seqs
            and num_seqs <= self.max_batch
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits (num_seqs, vocab) float32 of the step, from a graph when it is a decode step
        that fits, eagerly otherwise."""
        if not self.can_replay(input_ids, meta):
            return self.model(input_ids, positions, meta, self.kv_cache)
        n = input_ids.shape[0]
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        width = meta.block_tables.shape[1]
        for dst, src in (
            (self.input_ids[:n], input_ids),
            (self.positions[:n], positions),
            (self.slot_mapping[:n], meta.slot_mapping),
            (self.seq_lens[:n], meta.seq_lens),
            (self.block_tables[:n, :width], meta.block_tables),
        ):
            if src.data_ptr() != dst.data_ptr():  # already in place: see `static_inputs`
                dst.copy_(src, non_blocking=True)
        if batch > n:  # padding rows: write nowhere, attend over nothing
            self.slot_mapping[n:batch].fill_(-1)
            self.seq_lens[n:batch].fill_(0)
        self._graphs[batch].replay()
        return self._logits[batch][:n]
