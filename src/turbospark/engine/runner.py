"""Drives a model over the paged KV cache: one batched forward per engine step.

`ModelRunner.execute` is what the engine calls: every scheduled sequence feeds its next tokens
(prefill chunks and single decode tokens mixed in one packed batch) and the logits of each
sequence that samples come back. The runner owns the KV storage (`KVCache`) and the block
bookkeeping (`BlockManager`); the scheduler decides, through the block manager, which blocks a
sequence holds.

`forward` / `generate` are the one-sequence-at-a-time reference path (through
`turbospark.decode.run_decode_loop`) that the tests hold the batched engine to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from turbospark import handoff
from turbospark.backend import CancelFlag, CompletionResult, GenerationConfig, ProgressCallback
from turbospark.decode import run_decode_loop
from turbospark.engine import row_kernels
from turbospark.engine.attention import AttentionBackend, build_attention_metadata
from turbospark.engine.kv_cache import BlockManager, KVCache
from turbospark.engine.models import Model

if TYPE_CHECKING:
    from turbospark.engine.cuda_graphs import CudaGraphRunner
    from turbospark.engine.scheduler import ScheduledBatch


@dataclass(slots=True)
class StepInputs:
    """Everything one engine step's forward reads, as plain lists: sequence i has
    `num_cached[i]` tokens in the blocks of `block_tables[i]` and feeds `num_new[i]` new ones
    (packed, in order, in `input_ids`); logits come back for the sequences in `sample_rows`.

    This is the whole of what a tensor-parallel worker needs from rank 0 per step
    (`turbospark.engine.parallel`): the metadata is rebuilt from it identically on every rank.
    """

    input_ids: list[int]
    block_tables: list[list[int]]
    num_cached: list[int]
    num_new: list[int]
    sample_rows: list[int]
    num_prompt: list[int] | None = None  # each sequence's prompt length (row roles, `row_kernels`)


@dataclass(slots=True)
class SequenceState:
    """One sequence's cache ownership on the reference path: its blocks, how many tokens are in."""

    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0


class ModelRunner:
    def __init__(
        self,
        model: Model,
        *,
        max_context: int,
        num_blocks: int | None = None,
        max_num_seqs: int = 1,
        block_size: int = 16,
        prefill_chunk_size: int = 256,
        device: torch.device | str = "cpu",
        kv_dtype: torch.dtype | None = None,
        attention: AttentionBackend | None = None,
        enable_prefix_caching: bool = True,
        cuda_graphs: bool = True,
    ) -> None:
        """`num_blocks` sizes the KV cache (default: `max_num_seqs` full contexts). On CUDA the
        cache uses the Triton paged kernels (`CudaAttention`) and decode steps replay CUDA
        graphs (captured on the first step) unless `cuda_graphs` is off."""
        cfg = model.config
        assert max_context <= model.max_positions, "the model's rotary table is shorter than max_context"
        self.model = model
        self.max_context = max_context
        self.prefill_chunk_size = prefill_chunk_size
        self.device = torch.device(device)
        if kv_dtype is None:
            kv_dtype = model.dtype
        if num_blocks is None:
            num_blocks = (max_context + block_size - 1) // block_size * max_num_seqs
        is_cuda = self.device.type == "cuda"
        if attention is None and is_cuda:
            from turbospark.engine.cuda_attention import CudaAttention

            attention = CudaAttention()
        self.kv_cache = KVCache(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            kv_dtype,
            self.device,
            attention=attention,
        )
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        # rows run by role on the CPU: a generated token's keys stay out of the prefix cache
        self.block_manager.cache_generated = self.device.type != "cpu" or not row_kernels.reproducible()
        self.graphs: CudaGraphRunner | None = None
        if is_cuda and cuda_graphs:
            from turbospark.engine.cuda_graphs import CudaGraphRunner

            max_blocks = (max_context + block_size - 1) // block_size
            self.graphs = CudaGraphRunner(model, self.kv_cache, max_blocks_per_seq=max_blocks)
        self._captured = False

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """What one forward over the scheduled batch needs, in plain lists (see `StepInputs`)."""
        flat_ids: list[int] = []
        for seq, n in zip(batch.seqs, batch.num_new, strict=True):
            flat_ids.extend(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n])
        return StepInputs(
            input_ids=flat_ids,
            block_tables=[seq.block_table for seq in batch.seqs],
            num_cached=[seq.num_computed_tokens for seq in batch.seqs],
            num_new=list(batch.num_new),
            sample_rows=[i for i, wants in enumerate(batch.samples) if wants],
            num_prompt=[seq.num_prompt_tokens for seq in batch.seqs],
        )

    def execute(self, batch: ScheduledBatch) -> torch.Tensor:
        """One forward over the step; logits (num_sampling, vocab) float32, batch order."""
        return self.run_step(self.step_inputs(batch))

    def execute_greedy(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int] | None]:
        """`execute`, and each sampling row's argmax over its logits when the forward found them
        on the way (a native decode step in which every sequence samples); else None. The engine
        asks for it when every sampling row is an argmax-only greedy one."""
        argmax: list[torch.Tensor] = []
        step = self.step_inputs(batch)
        logits = self.run_step(step, argmax)
        if argmax and len(step.sample_rows) == len(step.num_new) == argmax[0].shape[0]:
            return logits, argmax[0].tolist()
        return logits, None

    @torch.inference_mode()
    def run_step(self, step: StepInputs, argmax: list[torch.Tensor] | None = None) -> torch.Tensor:
        """One forward over a step's inputs; logits (len(step.sample_rows), vocab) float32.
        `argmax`: see `CausalLM.forward` (eager forwards only)."""
        meta, positions = build_attention_metadata(
            step.block_tables, step.num_cached, step.num_new, self.kv_cache.block_size, self.device
        )
        meta.prompt_lens_host = step.num_prompt
        rows = step.sample_rows
        if len(rows) != len(step.num_new):
            # only sampling sequences need the lm_head: a mid-prefill chunk's logits are unused
            meta.last_token_indices = meta.last_token_indices[rows or [0]]
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        if self.graphs is not None:
            if not self._captured:
                self.graphs.capture()  # seconds, once: on the engine thread, off the event loop
                self._captured = True
            handoff.release()  # the GPU runs the step: the event loop may run meanwhile
            logits = self.graphs(input_ids, positions, meta)  # replays decode steps, else eager
        else:
            logits = self.model(input_ids, positions, meta, self.kv_cache, argmax=argmax)
        return logits[: len(rows)]

    # ---- the one-sequence reference path ----
    def release(self, seq: SequenceState) -> None:
        self.block_manager.release(seq.block_table)
        seq.num_cached = 0

    @torch.inference_mode()
    def forward(self, batch: Sequence[tuple[SequenceState, Sequence[int]]]) -> torch.Tensor:
        """Feeds each sequence its new token ids; returns logits (num_seqs, vocab) float32.

        Raises RuntimeError (with nothing changed) if the cache cannot hold the step.
        """
        for seq, new_ids in batch:
            assert new_ids, "every sequence in a step feeds at least one token"
            total = seq.num_cached + len(new_ids)
            if total > self.max_context or not self.block_manager.grow(seq.block_table, total):
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
        """One request, start to finish, through the sequential decode loop (the reference)."""
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
