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

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from turbospark import handoff
from turbospark.backend import CancelFlag, CompletionResult, GenerationConfig, ProgressCallback
from turbospark.decode import run_decode_loop
from turbospark.engine import row_kernels
from turbospark.engine.attention import AttentionBackend, AttentionMetadata, build_attention_metadata
from turbospark.engine.engine import StepOutput
from turbospark.engine.kv_cache import BlockManager, KVCache
from turbospark.engine.models import Model
from turbospark.engine.models.base import CausalLM
from turbospark.engine.native_decode import NativeDecoder

if TYPE_CHECKING:
    from turbospark.engine.cuda_graphs import CudaGraphRunner
    from turbospark.engine.scheduler import ScheduledBatch


class Wakeups(Protocol):
    """Where the runner lets the engine thread's held event-loop wake-ups go
    (`turbospark.handoff`, which the engine thread holds): before a long call that holds no
    GIL, and, for a short one that comes round again soon (one decode step), `release_step`."""

    def release(self) -> None: ...

    def release_step(self) -> None: ...


@dataclass(slots=True)
class StepInputs:
    """Everything one engine step's forward reads, as plain lists: sequence i has
    `num_cached[i]` tokens in the blocks of `block_tables[i]` and feeds `num_new[i]` new ones
    (packed, in order, in `input_ids`); logits come back for the sequences in `sample_rows`:
    for each, its last `num_logits[j]` positions (one where `num_logits` is empty; more for a
    sequence verifying speculative drafts), in order.

    This is the whole of what a tensor-parallel worker needs from rank 0 per step
    (`turbospark.engine.parallel`): the metadata is rebuilt from it identically on every rank.
    """

    input_ids: list[int]
    block_tables: list[list[int]]
    num_cached: list[int]
    num_new: list[int]
    sample_rows: list[int]
    num_logits: list[int] = field(default_factory=list)
    # a vision model's image tokens in this step: (packed rows, their input embeddings); rank 0
    # only (vision models run in one process)
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    num_prompt: list[int] | None = None  # each sequence's prompt length (row roles, `row_kernels`)


def verify_rows_as_decodes(step: StepInputs) -> StepInputs:
    """The step with each sequence that verifies drafts (its last token and k drafts, k + 1
    logits) cut into k + 1 one-token sequences over the same blocks, the j-th with j more tokens
    cached: the rows a plain decode would have fed one step at a time. On the CPU they then run
    as decode rows (`row_kernels`): the native kernels, which read a weight once for up to eight
    rows, so a verification costs about one decode step; and they compute each position as
    plain decoding does, so greedy speculation gives decoding's tokens bit for bit. Attention
    sees the same thing either way: a step writes every row's keys before any row attends, and
    each one-token sequence attends up to its own position. Logits come back in the original
    order (sample rows ascending, each verifier's positions in order)."""
    wants = dict(zip(step.sample_rows, step.num_logits, strict=True))
    if any(c > 1 and c != step.num_new[i] for i, c in wants.items()):
        return step  # a sequence that feeds more than it verifies: not the shape cut here
    out = StepInputs(input_ids=step.input_ids, block_tables=[], num_cached=[], num_new=[], sample_rows=[])
    prompts: list[int] = []
    for i, (table, cached, new) in enumerate(
        zip(step.block_tables, step.num_cached, step.num_new, strict=True)
    ):
        split = wants.get(i, 1) > 1
        for j in range(new if split else 1):
            if i in wants:
                out.sample_rows.append(len(out.num_new))
            out.block_tables.append(table)
            out.num_cached.append(cached + j)
            out.num_new.append(1 if split else new)
            if step.num_prompt is not None:
                prompts.append(step.num_prompt[i])
    out.num_prompt = prompts if step.num_prompt is not None else None
    return out


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
        max_step_tokens: int = 256,
        wakeups: Wakeups = handoff,
    ) -> None:
        """`num_blocks` sizes the KV cache (default: `max_num_seqs` full contexts). On CUDA the
        cache uses the Triton paged kernels (`CudaAttention`) and, unless `cuda_graphs` is off,
        decode steps replay CUDA graphs and other steps of up to `max_step_tokens` tokens (the
        scheduler's step budget; 0: none) replay piecewise graphs, all captured on the first
        step."""
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
            from turbospark.engine.cuda_graphs import CudaGraphRunner, piecewise_sizes

            max_blocks = (max_context + block_size - 1) // block_size
            mixed = piecewise_sizes(max_step_tokens) if max_step_tokens > 0 else ()
            self.graphs = CudaGraphRunner(
                model, self.kv_cache, max_blocks_per_seq=max_blocks, mixed_sizes=mixed
            )
        self._captured = False
        self.wakeups = wakeups
        self._native: NativeDecoder | bool | None = False

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def step_inputs(self, batch: ScheduledBatch) -> StepInputs:
        """What one forward over the scheduled batch needs, in plain lists (see `StepInputs`)."""
        flat_ids: list[int] = []
        for seq, n, d in zip(batch.seqs, batch.num_new, batch.num_draft, strict=True):
            flat_ids.extend(seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n - d])
            if d:  # speculative drafts after the last known token
                flat_ids.extend(seq.draft_ids[:d])
        rows = [i for i, wants in enumerate(batch.samples) if wants]
        step = StepInputs(
            input_ids=flat_ids,
            block_tables=[seq.block_table for seq in batch.seqs],
            num_cached=[seq.num_computed_tokens for seq in batch.seqs],
            num_new=list(batch.num_new),
            sample_rows=rows,
            num_logits=[1 + batch.num_draft[i] for i in rows] if any(batch.num_draft) else [],
            num_prompt=[seq.num_prompt_tokens for seq in batch.seqs],
        )
        encode = getattr(self.model, "encode_images", None)
        if encode is not None:  # images are encoded here, on the engine thread, when first due
            from turbospark.engine.vision import step_embeds

            states = [seq.runner_state for seq in batch.seqs]
            step.embeds = step_embeds(states, step.num_cached, step.num_new, encode, self.device)
        return step

    def execute(self, batch: ScheduledBatch, *, want_ids: bool = False) -> StepOutput:
        """One forward over the step (see `engine.StepRunner`)."""
        return self.run_step(self.step_inputs(batch), want_ids=want_ids)

    @torch.inference_mode()
    def run_step(self, step: StepInputs, *, want_ids: bool = False) -> StepOutput:
        """One forward over a step's inputs, by one of three strategies: a CUDA graph replay
        (decode-only steps on CUDA; others eager inside `CudaGraphRunner`), the CPU's one-call
        native decode step (`NativeDecoder`, all-decode steps it takes), or the model's own
        layer-by-layer forward (image tokens always). Logits come back for `sample_rows` (with
        `num_logits`: sum(num_logits) rows, each verifying sequence's last positions). Each
        strategy releases the held event-loop wake-ups as it enters its long call, where the
        loop's Python runs beside it instead of contending for the GIL."""
        if step.num_logits and self.device.type == "cpu" and step.embeds is None:
            step = verify_rows_as_decodes(step)
        meta, positions = build_attention_metadata(
            step.block_tables, step.num_cached, step.num_new, self.kv_cache.block_size, self.device
        )
        meta.prompt_lens_host = step.num_prompt
        rows = step.sample_rows
        if step.num_logits:
            # sequences that verify drafts get the logits of every position from their last
            # known token on
            ends = list(itertools.accumulate(step.num_new))
            picked = [
                p for r, c in zip(rows, step.num_logits, strict=True) for p in range(ends[r] - c, ends[r])
            ]
            meta.last_token_indices = torch.tensor(picked, dtype=torch.long, device=self.device)
            rows = picked
        elif len(rows) != len(step.num_new):
            # only sampling sequences need the lm_head: a mid-prefill chunk's logits are unused
            meta.last_token_indices = meta.last_token_indices[rows or [0]]
        input_ids = torch.tensor(step.input_ids, dtype=torch.long, device=self.device)
        if step.embeds is not None:  # image tokens: a prefill chunk, always eager, layer by layer
            self.wakeups.release()
            embeds = step.embeds
            out = StepOutput(self.model(input_ids, positions, meta, self.kv_cache, embeds=embeds))  # type: ignore[call-arg]
        elif self.graphs is not None:
            if not self._captured:
                self.graphs.capture()  # seconds, once: on the engine thread, off the event loop
                self._captured = True
            self.wakeups.release()  # the GPU runs the step: the event loop may run meanwhile
            return StepOutput(self.graphs(input_ids, positions, meta)[: len(rows)])
        else:
            # a verification's several logits a sequence run as one forward (not by role)
            by_role = not step.num_logits
            out = self._forward(input_ids, positions, meta, want_ids=want_ids, by_role=by_role)
        out.logits = out.logits[: len(rows)]
        return out

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        *,
        want_ids: bool,
        by_role: bool = True,
    ) -> StepOutput:
        """The eager forward. On the CPU (unless fast_nondeterministic, `kernel_settings`) a step's rows
        run the kernels of their role, a step of decode and prompt rows as one forward per role
        (`row_kernels`), so a sequence's tokens do not depend on what shares its step."""
        if by_role and input_ids.is_cpu and row_kernels.role() is None and row_kernels.reproducible():
            return self._forward_by_role(input_ids, positions, meta, want_ids=want_ids)
        return self._forward_one(input_ids, positions, meta, want_ids=want_ids)

    def _forward_by_role(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *, want_ids: bool
    ) -> StepOutput:
        """The step as the forwards `row_kernels.split_step` cuts it into, each under its role;
        logits (and argmax ids) put back in the step's order of sampling sequences."""
        qlens = meta.query_lens_host
        is_decode = row_kernels.decode_sequences(qlens, meta.seq_lens_host, meta.prompt_lens_host)
        parts = row_kernels.split_step(is_decode)
        if parts is None:
            with row_kernels.rows_as("decode" if is_decode[0] else "prompt"):
                return self._forward_one(input_ids, positions, meta, want_ids=want_ids)
        starts = [0, *itertools.accumulate(qlens)]
        seq_of_last_row = {starts[i + 1] - 1: i for i in range(len(qlens))}
        sampled = [seq_of_last_row[r] for r in meta.last_token_indices.tolist()]
        is_sampled = set(sampled)
        logits_of: dict[int, torch.Tensor] = {}
        ids_of: dict[int, int] = {}
        for role, seqs in parts:
            want = [i for i in seqs if i in is_sampled] or seqs[:1]
            sub, sub_positions = meta.select(seqs, want)
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in seqs])
            with row_kernels.rows_as(role):
                out = self._forward_one(input_ids[rows], sub_positions, sub, want_ids=want_ids)
            for j, i in enumerate(want):
                logits_of[i] = out.logits[j]
                if out.token_ids is not None:
                    ids_of[i] = out.token_ids[j]
        ids = [ids_of[i] for i in sampled] if want_ids and all(i in ids_of for i in sampled) else None
        return StepOutput(torch.stack([logits_of[i] for i in sampled]), ids)

    def _forward_one(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, *, want_ids: bool
    ) -> StepOutput:
        """One eager forward: the native one-call decode step where it takes the step (never
        under the prompt role), else the model's layer-by-layer forward."""
        decoder = self._native_decoder()
        if (
            decoder is not None
            and row_kernels.role() != "prompt"
            and decoder.takes(input_ids, meta, self.kv_cache)
        ):
            on_enter = self.wakeups.release_step
            logits, ids = decoder.step(input_ids, positions, meta, self.kv_cache, on_enter, want_ids=want_ids)
            return StepOutput(logits, ids)
        self.wakeups.release()  # layer by layer, torch lets the GIL go around every op
        return StepOutput(self.model(input_ids, positions, meta, self.kv_cache))

    def _native_decoder(self) -> NativeDecoder | None:
        """The one-call native decode step, where the model's layers fit it (decided once, on
        the first step: after the load has quantized and placed the weights)."""
        if self._native is False:
            model = self.model
            on_cpu = self.device.type == "cpu" and isinstance(model, CausalLM)
            self._native = NativeDecoder.build(model) if on_cpu and isinstance(model, CausalLM) else None
        return self._native if isinstance(self._native, NativeDecoder) else None

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
        logits = self._forward(input_ids, positions, meta, want_ids=False).logits
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
