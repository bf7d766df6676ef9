"""Decode steps replayed from CUDA graphs; mixed steps replayed piecewise around attention.

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
its block table is at most `max_blocks_per_seq` wide. A replayed batch of n sequences is padded
to the next captured size: padding rows write no cache slot (slot -1) and attend over nothing
(length 0), so they cost a little compute and change nothing.

Every other step of at most the largest `mixed_sizes` tokens (a prefill chunk beside decodes,
the common step of a busy server) replays piecewise (`PiecewiseGraphs`): what a layer does
before and after its attention depends only on the token count, so it is captured once per
padded count; the attention, whose launches depend on the step's sequences, runs eagerly
between the pieces. Larger steps (a long prefill alone) run the model eagerly: their kernels
are long enough to hide the launches. Deciding costs no device sync: only shapes are read.

The logits of a replay are a view of the graph's static output buffer: read (sample) them before
the next call. The cache must be `KVCache` with a backend whose kernels are capturable
(`CudaAttention`); every captured graph shares one memory pool.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from turbospark.engine.attention import AttentionMetadata
from turbospark.engine.kv_cache import KVCache
from turbospark.engine.models import Model
from turbospark.engine.models.base import CausalLM, DecoderLayer

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# token counts of the piecewise graphs (a step's count is padded up to the next); `mixed_sizes`
# takes those up to the step budget
PIECEWISE_SIZES = (16, 32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def piecewise_sizes(max_tokens: int) -> tuple[int, ...]:
    """The `PIECEWISE_SIZES` a step budget of `max_tokens` tokens needs (through the first size
    that holds it; none over 512)."""
    sizes = [s for s in PIECEWISE_SIZES if s < max_tokens]
    sizes += [s for s in PIECEWISE_SIZES if s >= max_tokens][:1]
    return tuple(sizes)


class CudaGraphRunner:
    def __init__(
        self,
        model: Model,
        kv_cache: KVCache,
        *,
        max_blocks_per_seq: int,
        batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
        mixed_sizes: Sequence[int] = (),
    ) -> None:
        assert batch_sizes and min(batch_sizes) >= 1
        self.model = model
        # only a decoder with the layer split (`DecoderLayer.before_attention`) replays piecewise
        self.piecewise: PiecewiseGraphs | None = None
        if isinstance(model, CausalLM) and mixed_sizes:
            self.piecewise = PiecewiseGraphs(model, kv_cache, mixed_sizes)
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
        if self.piecewise is not None:
            self.piecewise.capture(pool)

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
            if self.piecewise is not None and self.piecewise.takes(input_ids):
                return self.piecewise(input_ids, positions, meta)
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


class PiecewiseGraphs:
    """A model's forward for steps of any mix of prefill chunks and decodes, replayed from CUDA
    graphs piece by piece: per padded token count, one graph from the embedding through layer
    0's q/k/v, one from each layer's attention output through the next layer's q/k/v, one from
    the last attention output through the last MLP (`DecoderLayer.before_attention` /
    `after_attention`). Between the pieces each layer's attention (cache store and paged
    attention, two launches) runs eagerly on the step's real rows and metadata, so a step costs
    num_layers + 1 replays and ~3 launches a layer instead of every op's launch; the final norm
    and lm_head run eagerly on the sampled rows only.

    The pieces talk through static buffers (ids, positions, rotary rows, q/k/v, attention output,
    hidden state and residual) sized for the largest count. Padding rows (a step of n tokens runs
    the graphs of the next size) hold whatever ids and positions earlier steps left, always
    valid ones; their rows go through the matmuls and norms, never into the cache or attention,
    and no real row reads them.
    """

    def __init__(self, model: CausalLM, kv_cache: KVCache, sizes: Sequence[int]) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sizes = sorted(set(sizes))
        self.max_tokens = self.sizes[-1]
        n = self.max_tokens
        self.layers = [layer for layer in model.model.layers if isinstance(layer, DecoderLayer)]
        assert len(self.layers) == len(model.model.layers)
        attn = self.layers[0].self_attn
        heads, kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        embed = model.model.embed_tokens
        dtype = embed.out_dtype or embed.weight.dtype
        device = kv_cache.k.device
        hidden = model.config.hidden_size
        rot_dtype = model.rotary.cos.dtype
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.cos = torch.zeros(n, 1, head_dim, dtype=rot_dtype, device=device)
        self.sin = torch.zeros(n, 1, head_dim, dtype=rot_dtype, device=device)
        self.q = torch.zeros(n, heads, head_dim, dtype=dtype, device=device)
        self.k = torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(n, kv_heads, head_dim, dtype=dtype, device=device)
        self.attended = torch.zeros(n, heads * head_dim, dtype=dtype, device=device)
        self.x = torch.zeros(n, hidden, dtype=dtype, device=device)
        self.residual = torch.zeros(n, hidden, dtype=dtype, device=device)
        # what `before_attention` is handed: read only by the fused small-batch projection, which
        # stores k/v itself and which no piecewise size takes (`capture` checks)
        self._meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=device),
            query_start_loc=torch.zeros(2, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(1, dtype=torch.int32, device=device),
            block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
            last_token_indices=torch.zeros(1, dtype=torch.long, device=device),
            block_size=kv_cache.block_size,
        )
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}

    def takes(self, input_ids: torch.Tensor) -> bool:
        return bool(self._graphs) and input_ids.shape[0] <= self.max_tokens

    def _before(self, index: int, x: torch.Tensor, residual: torch.Tensor | None, n: int) -> None:
        layer = self.layers[index]
        rope = (self.cos[:n], self.sin[:n])
        q, k, v, residual = layer.before_attention(x, residual, rope, self.kv_cache.layer(index), self._meta)
        if k is None:
            raise RuntimeError("a piecewise size took the fused projection that stores k/v itself")
        self.q[:n].copy_(q)
        self.k[:n].copy_(k)
        self.v[:n].copy_(v)
        self.residual[:n].copy_(residual)

    def _piece(self, index: int, n: int) -> None:
        """Piece `index`: 0 from the ids to layer 0's q/k/v; i from layer i-1's attention
        output to layer i's q/k/v (the last one: to the hidden state)."""
        model = self.model
        if index == 0:
            x = model.model.embed_tokens(self.input_ids[:n])
            cos, sin = model.rotary(self.positions[:n])
            self.cos[:n].copy_(cos)
            self.sin[:n].copy_(sin)
            self._before(0, x, None, n)
            return
        x, residual = self.layers[index - 1].after_attention(self.attended[:n], self.residual[:n])
        if index == len(self.layers):
            self.x[:n].copy_(x)
            self.residual[:n].copy_(residual)
        else:
            self._before(index, x, residual, n)

    @torch.inference_mode()
    def capture(self, pool: Any = None) -> None:
        """Captures every size's pieces (largest first), sharing `pool` with the decode graphs;
        each piece runs once before its capture (Triton compiles, cuBLAS picks its kernels)."""
        pieces = len(self.layers) + 1
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for n in reversed(self.sizes):
                for index in range(pieces):
                    self._piece(index, n)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for n in reversed(self.sizes):
            graphs = []
            for index in range(pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._piece(index, n)
                graphs.append(graph)
            self._graphs[n] = graphs
        torch.cuda.synchronize()

    @torch.inference_mode()
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits (num_seqs, vocab) float32 of the step, as `model(...)` gives them."""
        n = input_ids.shape[0]
        graphs = self._graphs[self.sizes[bisect.bisect_left(self.sizes, n)]]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        graphs[0].replay()
        q, k, v, attended = self.q[:n], self.k[:n], self.v[:n], self.attended[:n]
        for index, layer in enumerate(self.layers):
            attended.copy_(layer.self_attn.attend(q, k, v, self.kv_cache.layer(index), meta))
            graphs[index + 1].replay()
        return self.model.logits(self.x[:n], self.residual[:n], meta.last_token_indices)
