"""Drives a model over the paged KV cache: batched forward steps, chunked prefill, generation.

`ModelRunner.forward` is the one step function: any number of sequences, each feeding any
number of new tokens (prefill chunks and single decode tokens mixed), returns the logits of
each sequence's last new token. The scheduler for continuous batching calls it directly.
`ModelRunner.generate` serves one request at a time through `turbospark.decode.run_decode_loop`,
so its semantics (cancel polling, stop ids, length bound, progress callbacks) are exactly those
of the sequential loop: the cancel flag is polled once per prefill chunk and once per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from turbospark.backend import CancelFlag, CompletionResult, GenerationConfig, ProgressCallback
from turbospark.decode import run_decode_loop
from turbospark.engine.attention import build_attention_metadata
from turbospark.engine.kv_cache import KVCache
from turbospark.engine.models import Model


@dataclass(slots=True)
class SequenceState:
    """One sequence's cache ownership: its blocks and how many of its tokens are cached."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0


class ModelRunner:
    def __init__(
        self,
        model: Model,
        *,
        max_context: int,
        max_num_seqs: int = 1,
        block_size: int = 16,
        prefill_chunk_size: int = 256,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        cfg = model.config
        assert max_context <= model.max_positions, "the model's rotary table is shorter than max_context"
        self.model = model
        self.max_context = max_context
        self.prefill_chunk_size = prefill_chunk_size
        self.device = torch.device(device)
        if kv_dtype is None:
            kv_dtype = model.dtype
        blocks_per_seq = (max_context + block_size - 1) // block_size
        self.kv_cache = KVCache(
            cfg.num_hidden_layers,
            blocks_per_seq * max_num_seqs,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            kv_dtype,
            self.device,
        )

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def release(self, seq: SequenceState) -> None:
        self.kv_cache.release(seq.block_table)
        seq.num_cached = 0

    @torch.inference_mode()
    def forward(self, batch: Sequence[tuple[SequenceState, Sequence[int]]]) -> torch.Tensor:
        """Feeds each sequence its new token ids; returns logits (num_seqs, vocab) float32.

        Raises RuntimeError (with nothing changed) if the cache cannot hold the step.
        """
        for seq, new_ids in batch:
            assert new_ids, "every sequence in a step feeds at least one token"
            total = seq.num_cached + len(new_ids)
            if total > self.max_context or not self.kv_cache.grow(seq.block_table, total):
                raise RuntimeError(f"KV cache full: cannot hold {total} tokens for a sequence")
        flat_ids = [t for _, new_ids in batch for t in new_ids]
        meta, positions = build_attention_metadata(
            [seq.block_table for seq, _ in batch],
            [seq.num_cached for seq, _ in batch],
            [len(new_ids) for _, new_ids in batch],
            self.kv_cache.block_size,
            self.device,
        )
        input_ids = torch.tensor(flat_ids, dtype=torch.long, device=self.device)
        logits = self.model(input_ids, positions, meta, self.kv_cache)
        for seq, new_ids in batch:
            seq.num_cached += len(new_ids)
        return logits

    def prefill(
        self, seq: SequenceState, prompt_ids: Sequence[int], cancel: CancelFlag
    ) -> torch.Tensor | None:
        """Feeds the prompt in chunks; logits (vocab,) after it, or None if cancelled between chunks."""
        logits = None
        for start in range(0, len(prompt_ids), self.prefill_chunk_size):
            if cancel.is_set():
                return None
            logits = self.forward([(seq, prompt_ids[start : start + self.prefill_chunk_size])])[0]
        assert logits is not None, "empty prompt"
        return logits

    def generate(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig,
        cancel: CancelFlag,
        on_progress: ProgressCallback,
    ) -> CompletionResult:
        """One request, start to finish, through the sequential decode loop."""
        seq = SequenceState()
        try:
            return run_decode_loop(
                _SequenceProducer(self, seq), prompt_ids, config, self.max_context, cancel, on_progress
            )
        finally:
            self.release(seq)


class _SequenceProducer:
    """`LogitProducer` over one sequence of a runner."""

    def __init__(self, runner: ModelRunner, seq: SequenceState) -> None:
        self.runner = runner
        self.seq = seq

    def prefill(self, prompt_ids: Sequence[int], cancel: CancelFlag) -> torch.Tensor | None:
        return self.runner.prefill(self.seq, prompt_ids, cancel)

    def step(self, token_id: int) -> torch.Tensor:
        return self.runner.forward([(self.seq, [token_id])])[0]
